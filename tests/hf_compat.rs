//! Checkpoints cross between streamrl and Hugging Face `transformers` (PyPI) with the same
//! logits, both ways:
//! * written by streamrl, loaded by transformers: dense Qwen3 (q/k norm, tied embeddings,
//!   GQA), Qwen2 (attention bias), Llama (untied head) and Qwen3-MoE (4 experts, top 2);
//! * saved by transformers 5, loaded by streamrl: every family and each config variant
//!   streamrl supports (both RoPE config layouts, Llama 3 and linear RoPE scaling, Llama
//!   and Qwen3 biases, sliding windows that are off or span the context); the variants it
//!   cannot compute (YaRN and dynamic RoPE, active sliding windows, tensors the config
//!   does not use) are refused with an error naming them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

/// Runs a Python `script` with `args` in an interpreter that has torch and transformers
/// (installed for the tests when missing); its stdout is JSON.
fn transformers(script: &str, args: &[std::ffi::OsString]) -> serde_json::Value {
    let (python, path) = common::python_with(&["torch==2.15.0", "transformers==5.24.0"]);
    let mut cmd = Command::new(&python);
    cmd.arg("-c").arg(script).args(args);
    if let Some(p) = &path {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "transformers failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

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
    let mut args = vec![std::ffi::OsString::from(tokens)];
    args.extend(ours.iter().map(|(d, _)| d.clone().into_os_string()));
    let theirs = transformers(CHECK, &args);
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
    let theirs = transformers(TOKENIZER_CHECK, &[d.clone().into_os_string(), text.into()]);
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

/// Builds each model of the spec `{name: {model_type, ...config}}` in transformers with
/// random weights (norms near 1, biases included), saves it under `root/name` and prints
/// its logits for the tokens.
const BUILD: &str = r#"
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
spec, root = json.loads(sys.argv[1]), sys.argv[2]
toks = [int(t) for t in sys.argv[3].split(",")]
out = {}
for name, kw in spec.items():
    kw = dict(kw)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
        logits = m(torch.tensor([toks])).logits[0].tolist()
    m.save_pretrained(f"{root}/{name}")
    out[name] = {"class": type(m).__name__, "logits": logits}
print(json.dumps(out))
"#;

/// `streamrl model logits` of a checkpoint: the logits, or the error it printed.
fn streamrl_logits(dir: &Path, tokens: &str) -> Result<Vec<Vec<f64>>, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["model", "logits", "--tokens", tokens, "--checkpoint"])
        .arg(dir)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    Ok(serde_json::from_value(v["logits"].clone()).unwrap())
}

fn max_diff(a: &[Vec<f64>], b: &Value) -> f64 {
    let b: Vec<Vec<f64>> = serde_json::from_value(b.clone()).unwrap();
    assert_eq!(a.len(), b.len(), "one row per token");
    a.iter()
        .zip(&b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "vocabulary");
            x.iter().zip(y).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f64::max)
}

/// A copy of checkpoint `dir` at `to` with `edit` applied to its config.json.
fn with_config(dir: &Path, to: PathBuf, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> PathBuf {
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let path = to.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    to
}

#[test]
fn checkpoints_saved_by_transformers_load_with_the_same_logits_or_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // 24 positions: past the windows and original contexts below, where RoPE scaling and
    // sliding windows change the logits.
    let tokens: String = (0..24)
        .map(|i| ((i * 7 + 3) % 64).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let model = |model_type: &str, extra: Value| -> Value {
        let mut v = json!({
            "model_type": model_type, "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        });
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v
    };
    let llama3 = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
    let supported = [
        (
            "llama_rope_theta",
            model(
                "llama",
                json!({"rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}),
            ),
        ),
        ("llama3_rope", model("llama", json!({"rope_parameters": llama3}))),
        (
            "llama_linear_rope",
            model(
                "llama",
                json!({"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0}}),
            ),
        ),
        (
            "llama_biases_tied",
            model(
                "llama",
                json!({"attention_bias": true, "mlp_bias": true, "tie_word_embeddings": true}),
            ),
        ),
        ("mistral", model("mistral", json!({"sliding_window": null}))),
        (
            "mistral_window_spans_context",
            model("mistral", json!({"sliding_window": 64})),
        ),
        (
            "mixtral",
            model("mixtral", json!({"num_local_experts": 4, "num_experts_per_tok": 2})),
        ),
        ("qwen2", model("qwen2", json!({}))),
        (
            "qwen3_attention_bias",
            model("qwen3", json!({"attention_bias": true, "head_dim": 16})),
        ),
        (
            "qwen3_window_spans_context",
            model(
                "qwen3",
                json!({"use_sliding_window": true, "sliding_window": 64, "max_window_layers": 0}),
            ),
        ),
        (
            "qwen3_moe",
            model(
                "qwen3_moe",
                json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": true}),
            ),
        ),
    ];
    let refused = [
        (
            "llama_yarn",
            model(
                "llama",
                json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
            ),
        ),
        (
            "llama_dynamic",
            model(
                "llama",
                json!({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
            ),
        ),
        ("mistral_window", model("mistral", json!({"sliding_window": 8}))),
        (
            "qwen2_window",
            model(
                "qwen2",
                json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1}),
            ),
        ),
    ];
    let spec: serde_json::Map<String, Value> = supported
        .iter()
        .chain(&refused)
        .map(|(name, cfg)| (name.to_string(), cfg.clone()))
        .collect();
    let theirs = transformers(
        BUILD,
        &[
            Value::Object(spec).to_string().into(),
            dir.path().into(),
            tokens.clone().into(),
        ],
    );
    let saved = |name: &str| dir.path().join(name);

    for (name, _) in &supported {
        let mine = streamrl_logits(&saved(name), &tokens).unwrap_or_else(|e| panic!("{name}: {e}"));
        let d = max_diff(&mine, &theirs[*name]["logits"]);
        assert!(
            d < 1e-4,
            "{name} ({}): logits differ from transformers by up to {d}",
            theirs[*name]["class"]
        );
    }

    // transformers 4's layout: top-level rope_theta, rope_scaling with `type`.
    let old = with_config(&saved("llama3_rope"), dir.path().join("llama3_old_layout"), |c| {
        let mut rope = c.remove("rope_parameters").unwrap();
        let rope = rope.as_object_mut().unwrap();
        c.insert("rope_theta".into(), rope.remove("rope_theta").unwrap());
        let kind = rope.remove("rope_type").unwrap();
        rope.insert("type".into(), kind);
        c.insert("rope_scaling".into(), Value::Object(rope.clone()));
    });
    let d = max_diff(
        &streamrl_logits(&old, &tokens).unwrap(),
        &theirs["llama3_rope"]["logits"],
    );
    assert!(d < 1e-4, "llama3 RoPE in the rope_scaling layout: off by {d}");

    // The RoPE settings matter on these tokens: read as plain RoPE at the default base,
    // each checkpoint's logits move well past the tolerance (so the checks above can fail).
    for name in ["llama_rope_theta", "llama3_rope", "llama_linear_rope"] {
        let plain = with_config(&saved(name), dir.path().join(format!("{name}_plain")), |c| {
            c.insert(
                "rope_parameters".into(),
                json!({"rope_type": "default", "rope_theta": 10000.0}),
            );
        });
        let d = max_diff(&streamrl_logits(&plain, &tokens).unwrap(), &theirs[name]["logits"]);
        assert!(d > 1e-2, "{name}: plain RoPE gives nearly the same logits ({d})");
    }

    for (name, cfg) in &refused {
        let err = streamrl_logits(&saved(name), &tokens).expect_err(name);
        let want = match *name {
            "llama_yarn" => "rope_parameters.rope_type `yarn` is not supported".to_string(),
            "llama_dynamic" => "rope_parameters.rope_type `dynamic` is not supported".to_string(),
            _ => format!("sliding_window {} is active", cfg["sliding_window"]),
        };
        assert!(err.contains(&want), "{name}: want {want:?} in {err}");
    }

    // Tensors the config does not use are an error, not ignored: the biased Llama read
    // with its biases switched off.
    let unbiased = with_config(&saved("llama_biases_tied"), dir.path().join("unbiased"), |c| {
        c.insert("attention_bias".into(), json!(false));
        c.insert("mlp_bias".into(), json!(false));
    });
    let err = streamrl_logits(&unbiased, &tokens).expect_err("unused bias tensors");
    assert!(
        err.contains("14 tensor(s) the Llama model does not use")
            && err.contains("`model.layers.0.mlp.down_proj.bias`"),
        "{err}"
    );
}

/// transformers loads a checkpoint written by `streamrl model import` from the SmolLM2 GGUF:
/// its chat template renders the same prompt, its tokenizer gives the same ids, and its
/// model the same logits as streamrl's.
const IMPORTED: &str = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
ckpt, messages, ours = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
tok = AutoTokenizer.from_pretrained(ckpt)
text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
ids = tok(text, add_special_tokens=False)["input_ids"]
m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
with torch.no_grad():
    logits = m(torch.tensor([ids])).logits[0]
mine = torch.tensor(json.load(open(ours))["logits"])
diff = (logits - mine).abs().max().item() if mine.shape == logits.shape else None
print(json.dumps({"text": text, "ids": ids, "eos": tok.eos_token, "max_diff": diff,
                  "argmax_equal": bool((logits.argmax(-1) == mine.argmax(-1)).all()) if diff is not None else False}))
"#;

#[test]
fn a_gguf_imported_by_streamrl_loads_in_transformers_with_its_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("smollm2");
    let bin = env!("CARGO_BIN_EXE_streamrl");
    let out = Command::new(bin)
        .args(["model", "import", "--gguf"])
        .arg(common::smollm2::smollm2_gguf())
        .arg("--out")
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("with its chat template"));
    // streamrl's own rendering and tokens.
    let messages = json!([
        {"role": "system", "content": "Answer with a number in \\boxed{}."},
        {"role": "user", "content": "What is 12 + 30?"}
    ]);
    let chat: Vec<streamrl_model::chat::ChatMessage> = messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| streamrl_model::chat::ChatMessage {
            role: m["role"].as_str().unwrap().into(),
            content: m["content"].as_str().unwrap().into(),
        })
        .collect();
    let text = streamrl_model::chat::ChatTemplate::for_checkpoint(&ckpt)
        .unwrap()
        .render(&chat, true)
        .unwrap();
    let tok = streamrl_model::Tokenizer::from_file(&ckpt.join("tokenizer.json")).unwrap();
    let ids = tok.encode(&text).unwrap();
    let tokens: Vec<String> = ids.iter().map(u32::to_string).collect();
    let logits = Command::new(bin)
        .args(["model", "logits", "--tokens", &tokens.join(","), "--checkpoint"])
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(logits.status.success(), "{}", String::from_utf8_lossy(&logits.stderr));
    let ours = dir.path().join("ours.json");
    std::fs::write(&ours, &logits.stdout).unwrap();
    let theirs = transformers(
        IMPORTED,
        &[ckpt.clone().into(), messages.to_string().into(), ours.into()],
    );
    assert_eq!(theirs["text"], text.as_str(), "chat template rendering");
    let their_ids: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
    assert_eq!(their_ids, ids, "token ids of the rendered chat");
    assert_eq!(theirs["eos"], "<|im_end|>");
    let d = theirs["max_diff"].as_f64().expect("same logits shape");
    eprintln!("{} positions, largest logit difference {d:.2e}", ids.len());
    assert!(
        d < 1e-3 && theirs["argmax_equal"] == true,
        "logits differ from transformers by up to {d} over {} positions",
        ids.len()
    );
}

/// The logits of each checkpoint in float32, under bf16 autocast (f32 weights, bf16
/// products: what streamrl's `dtype: bf16` does on the CPU) and with the model in bfloat16.
const BF16_CHECK: &str = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM
toks = torch.tensor([[int(t) for t in sys.argv[1].split(",")]])
out = {}
for d in sys.argv[2:]:
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        f = m(toks).logits[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = m(toks).logits[0].float()
        w = b(toks).logits[0].float()
    out[d] = {"f32": f.tolist(), "autocast": a.tolist(), "bf16": w.tolist()}
print(json.dumps(out))
"#;

/// streamrl's bf16 products against transformers in bf16, on checkpoints transformers
/// saved (Llama with biases, Qwen2, Qwen3): streamrl's bf16 logits are no further from the
/// float32 logits than transformers' own bf16 logits are (autocast or the model in
/// bfloat16, whichever is closer, with 50% and 1e-3 to spare: both round the same products'
/// inputs, in different orders), within 3% of the logits' scale of transformers' autocast,
/// and, where the CPU has bf16 units, not the float32 logits (the products ran in bf16).
#[test]
fn bf16_logits_are_as_close_to_float32_as_transformers_bf16() {
    common::onednn();
    let dir = tempfile::tempdir().unwrap();
    let tokens: String = (0..24)
        .map(|i| ((i * 7 + 3) % 64).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let base = json!({
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
    });
    let mut spec = serde_json::Map::new();
    for (name, kind, extra) in [
        ("llama", "llama", json!({"attention_bias": true, "mlp_bias": true})),
        ("qwen2", "qwen2", json!({})),
        ("qwen3", "qwen3", json!({"head_dim": 16})),
    ] {
        let mut v = base.clone();
        v["model_type"] = json!(kind);
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        spec.insert(name.into(), v);
    }
    transformers(
        BUILD,
        &[
            Value::Object(spec.clone()).to_string().into(),
            dir.path().into(),
            tokens.clone().into(),
        ],
    );
    let dirs: Vec<PathBuf> = spec.keys().map(|n| dir.path().join(n)).collect();
    let mut args = vec![std::ffi::OsString::from(&tokens)];
    args.extend(dirs.iter().map(|d| d.clone().into_os_string()));
    let theirs = transformers(BF16_CHECK, &args);
    let mut paths = Vec::new();
    for d in &dirs {
        let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
            .args([
                "model",
                "logits",
                "--dtype",
                "bf16",
                "--tokens",
                &tokens,
                "--checkpoint",
            ])
            .arg(d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let path = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let ours: Vec<Vec<f64>> =
            serde_json::from_value(serde_json::from_slice::<Value>(&out.stdout).unwrap()["logits"].clone()).unwrap();
        let t = &theirs[d.to_str().unwrap()];
        let f32: Vec<Vec<f64>> = serde_json::from_value(t["f32"].clone()).unwrap();
        let scale = f32.iter().flatten().fold(0f64, |m, x| m.max(x.abs()));
        let ours_err = max_diff(&ours, &t["f32"]);
        let their_err = max_diff(&f32, &t["autocast"]).min(max_diff(&f32, &t["bf16"]));
        let name = d.file_name().unwrap().to_string_lossy();
        assert!(
            ours_err <= 1.5 * their_err + 1e-3,
            "{name}: streamrl bf16 is {ours_err} from float32, transformers bf16 {their_err} ({path})"
        );
        let to_autocast = max_diff(&ours, &t["autocast"]);
        assert!(
            to_autocast <= 0.03 * scale,
            "{name}: {to_autocast} from autocast (scale {scale})"
        );
        if !path.contains("f32 fallback") {
            assert!(
                ours_err > 0.0,
                "{name}: bf16 logits equal float32 ones: the products did not run in bf16 ({path})"
            );
        } else if paths.is_empty() {
            common::skip::skipped(
                "bf16_logits_are_as_close_to_float32_as_transformers_bf16",
                "bf16 products on bf16 units (the f32 fallback ran; the tolerances were checked on it)",
                "this CPU has neither AMX nor AVX-512 BF16",
            );
        }
        paths.push(format!(
            "{name}: streamrl {ours_err:.2e}, transformers {their_err:.2e} from float32"
        ));
        if paths.len() == 1 {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "hf_compat bf16: {path}");
        }
    }
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "hf_compat bf16: {}", paths.join("; "));
}
