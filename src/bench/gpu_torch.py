# `streamrl bench gpu`'s PyTorch baseline: a transformers LlamaForCausalLM of each shape
# (JSON in argv[8:]) on the same device and dtype; prints one JSON line per shape with
# training tokens/s (best of `steps`, AdamW) and greedy decode tokens/s at each decode
# batch (argv[7], comma-separated).
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
device, dtype = sys.argv[1], {"bf16": torch.bfloat16, "f32": torch.float32}[sys.argv[2]]
batch, seq, steps, tokens = map(int, sys.argv[3:7])
decode_batches = [int(b) for b in sys.argv[7].split(",")]
if device == "cpu":
    torch.set_num_threads(1)
def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
for spec in map(json.loads, sys.argv[8:]):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["d"], intermediate_size=spec["ff"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv"], rms_norm_eps=1e-5, rope_theta=spec["theta"],
                      max_position_embeddings=max(seq, 128), tie_word_embeddings=spec["tied"])
    m = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    v = spec["vocab"]
    ids = torch.tensor([[(r * 7 + i * 13) % v for i in range(seq)] for r in range(batch)], device=device)
    best = float("inf")
    for i in range(steps + 1):
        sync(); t0 = time.perf_counter()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        sync()
        if i > 0:
            best = min(best, time.perf_counter() - t0)
    out = {"train": batch * seq / best}
    m.eval()
    for b in decode_batches:
        p = torch.tensor([[(s + i * 7) % v for i in range(16)] for s in range(b)], device=device)
        kw = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            m.generate(p, **kw); sync()
            t0 = time.perf_counter(); g = m.generate(p, **kw); sync()
        out[f"b{b}"] = (g.shape[1] - 16) * b / (time.perf_counter() - t0)
    print(json.dumps(out), flush=True)
