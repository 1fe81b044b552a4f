//! A checkpoint written by streamrl loads in Hugging Face `transformers` (PyPI) with the
//! same logits: dense Qwen3 (q/k norm, tied embeddings, GQA), Qwen2 (attention bias),
//! Llama (untied head) and Qwen3-MoE (4 experts, top 2).

mod common;

use std::process::Command;

const CHECK: &str = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM
toks = [int(t) for t in sys.argv[1].split(",")]
out = {}
for d in sys.argv[2:]:
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        out[d] = {"class": type(m).__name__, "logits": m(torch.tensor([toks])).logits[0].tolist()}
print(json.dumps(out))
"#;

#[test]
fn checkpoints_load_in_transformers_with_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_streamrl");
    let tokens = "5,9,13,2,40,41,7,88,3";
    let kinds = [
        ("qwen3", "Qwen3ForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("llama", "LlamaForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ];
    let mut ours = Vec::new();
    for (kind, _) in kinds {
        let d = dir.path().join(kind);
        let init = Command::new(bin)
            .args([
                "model",
                "init",
                "--preset",
                "tiny",
                "--seed",
                "3",
                "--model-type",
                kind,
                "--out",
            ])
            .arg(&d)
            .output()
            .unwrap();
        assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
        let out = Command::new(bin)
            .args(["model", "logits", "--tokens", tokens, "--checkpoint"])
            .arg(&d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        ours.push((d, v["logits"].clone()));
    }
    let (python, path) = common::python_with(&["torch==2.15.0", "transformers==5.24.0"]);
    // `script` run by the interpreter that has torch and transformers.
    let python_script = |script: &str| {
        let mut cmd = Command::new(&python);
        cmd.arg("-c").arg(script);
        if let Some(p) = &path {
            cmd.env("PYTHONPATH", p);
        }
        cmd
    };
    let out = python_script(CHECK)
        .arg(tokens)
        .args(ours.iter().map(|(d, _)| d))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "transformers failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for ((d, mine), (kind, class)) in ours.iter().zip(kinds) {
        let t = &theirs[d.to_str().unwrap()];
        assert_eq!(t["class"], class, "{kind}");
        let (a, b) = (mine.as_array().unwrap(), t["logits"].as_array().unwrap());
        assert_eq!((a.len(), b.len()), (9, 9), "{kind}: one row per token");
        let mut max = 0f64;
        for (ra, rb) in a.iter().zip(b) {
            let (ra, rb) = (ra.as_array().unwrap(), rb.as_array().unwrap());
            assert_eq!(ra.len(), rb.len(), "{kind}: vocabulary");
            for (x, y) in ra.iter().zip(rb) {
                max = max.max((x.as_f64().unwrap() - y.as_f64().unwrap()).abs());
            }
        }
        assert!(max < 1e-4, "{kind}: logits differ from transformers by up to {max}");
    }

    // The tokenizer files load in `tokenizers` (Oniguruma regexes) through AutoTokenizer,
    // with tokenizer_config.json's special tokens, and agree with streamrl's tokenizer.
    let d = &ours[0].0;
    let text = "12+30=42\nWhat is 7*8? {x}~<eos>";
    let out = python_script(TOKENIZER_CHECK).arg(d).arg(text).output().unwrap();
    assert!(
        out.status.success(),
        "AutoTokenizer failed on {}: {}",
        d.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tok = streamrl_model::Tokenizer::from_file(&d.join("tokenizer.json")).unwrap();
    let ids = tok.encode(text).unwrap();
    let their_ids: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
    assert_eq!(their_ids, ids, "token ids of {text:?}");
    assert_eq!(theirs["decoded"], tok.decode(&ids).unwrap(), "decoded text");
    assert_eq!(theirs["eos"], "<eos>");
    assert_eq!(theirs["eos_id"], tok.eos.unwrap());
}

const TOKENIZER_CHECK: &str = r#"
import json, sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
ids = t.encode(sys.argv[2], add_special_tokens=False)
print(json.dumps({"ids": ids, "decoded": t.decode(ids), "eos": t.eos_token, "eos_id": t.eos_token_id}))
"#;
