//! Checkpoints in the Hugging Face layout: `config.json`, `model.safetensors` (or sharded
//! with `model.safetensors.index.json`) and `tokenizer.json`. Written atomically (a
//! temporary directory renamed into place); loaded into trainable f32 or bf16 variables
//! ([`load_as`]), saved in the dtype they have.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use sha2::{Digest, Sha256};

use crate::config::{Config, HfConfig};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result, Transformer};

/// A loaded checkpoint: configuration, trainable variables, model and tokenizer.
pub struct Loaded {
    /// config.json as read.
    pub hf: HfConfig,
    /// Resolved configuration.
    pub config: Config,
    /// The trainable variables (HF names).
    pub vars: VarMap,
    /// The model over `vars`.
    pub model: Transformer,
    /// tokenizer.json, when present.
    pub tokenizer: Option<Tokenizer>,
}

/// A fresh, randomly initialised model for `hf` (seed 0).
pub fn init(hf: &HfConfig, device: &Device) -> Result<Loaded> {
    init_seeded(hf, device, Some(0))
}

/// A model whose variables are randomly initialised from `seed` (each variable from its own
/// stream, derived from its name), or zero-filled with `None` when every weight is about to
/// be overwritten by a checkpoint. (candle's own randn draws ~2 M values/s here: a 135M
/// model took a minute to initialise.)
pub fn init_seeded(hf: &HfConfig, device: &Device, seed: Option<u64>) -> Result<Loaded> {
    init_as(hf, device, DType::F32, seed)
}

/// [`init_seeded`] with weights of `dtype` (f32 or bf16; values drawn in f32, then
/// rounded).
pub fn init_as(hf: &HfConfig, device: &Device, dtype: DType, seed: Option<u64>) -> Result<Loaded> {
    let config = hf.resolve()?;
    let vars = VarMap::new();
    let backend = FastInit {
        vars: vars.clone(),
        seed,
    };
    let vb = VarBuilder::from_backend(Box::new(backend), dtype, device.clone());
    let model = Transformer::load(vb, &config)?;
    Ok(Loaded {
        hf: hf.clone(),
        config,
        vars,
        model,
        tokenizer: None,
    })
}

/// Creates variables in a [`VarMap`] with a fast seeded initialiser.
struct FastInit {
    vars: VarMap,
    seed: Option<u64>,
}

impl candle_nn::var_builder::SimpleBackend for FastInit {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut data = self
            .vars
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("var map lock poisoned".into()))?;
        if let Some(v) = data.get(name) {
            if v.shape() != &shape {
                return Err(candle_core::Error::Msg(format!(
                    "variable `{name}` exists with shape {:?}, asked for {shape:?}",
                    v.dims()
                )));
            }
            return Ok(v.as_tensor().clone());
        }
        let n = shape.elem_count();
        let t = match (self.seed, init) {
            (None, _) => Tensor::zeros(shape, dtype, dev)?,
            (Some(_), candle_nn::Init::Const(c)) => (Tensor::ones(shape, dtype, dev)? * c)?,
            (Some(seed), candle_nn::Init::Randn { mean, stdev }) => {
                use rand::{Rng, SeedableRng};
                use std::hash::Hasher as _;
                // FNV-1a of the name, its offset basis mixed with the seed.
                let mut h = fnv::FnvHasher::with_key(seed ^ 0xcbf2_9ce4_8422_2325);
                h.write(name.as_bytes());
                let mut rng = rand::rngs::SmallRng::seed_from_u64(h.finish());
                let mut v = Vec::with_capacity(n + 1);
                while v.len() < n {
                    // Box–Muller: two normals per pair of uniforms.
                    let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
                    let r = (-2.0 * u1.ln()).sqrt();
                    let a = std::f64::consts::TAU * u2;
                    v.push((mean + stdev * r * a.cos()) as f32);
                    v.push((mean + stdev * r * a.sin()) as f32);
                }
                v.truncate(n);
                Tensor::from_vec(v, shape, dev)?.to_dtype(dtype)?
            }
            (Some(_), _) => Tensor::zeros(shape, dtype, dev)?,
        };
        let var = candle_core::Var::from_tensor(&t)?;
        let out = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(out)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        let data = self
            .vars
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("var map lock poisoned".into()))?;
        data.get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| candle_core::Error::Msg(format!("no variable `{name}`")))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars.data().lock().map(|d| d.contains_key(name)).unwrap_or(false)
    }
}

/// Saves `vars` (and the config and tokenizer) to `dir`, replacing it atomically. Returns
/// the SHA-256 of the weights file. `shard_bytes` splits weights into several files with
/// an index, like large HF checkpoints.
pub fn save(
    dir: &Path,
    hf: &HfConfig,
    vars: &VarMap,
    tokenizer: Option<&Tokenizer>,
    shard_bytes: Option<usize>,
) -> Result<String> {
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(Error::io("creating", parent))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(Error::io("clearing", &tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(Error::io("creating", &tmp))?;
    let tensors: BTreeMap<String, Tensor> = vars
        .data()
        .lock()
        .map_err(|_| Error::Shape("var map lock poisoned".into()))?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let mut hasher = Sha256::new();
    match shard_bytes {
        None => {
            let p = tmp.join("model.safetensors");
            candle_core::safetensors::save(&tensors.into_iter().collect::<HashMap<_, _>>(), &p)?;
            hasher.update(std::fs::read(&p).map_err(Error::io("reading", &p))?);
        }
        Some(limit) => {
            let mut shards: Vec<HashMap<String, Tensor>> = vec![HashMap::new()];
            let mut size = 0;
            for (k, t) in tensors {
                let bytes = t.elem_count() * t.dtype().size_in_bytes();
                if size > 0 && size + bytes > limit {
                    shards.push(HashMap::new());
                    size = 0;
                }
                size += bytes;
                shards.last_mut().expect("one shard").insert(k, t);
            }
            let n = shards.len();
            let mut weight_map = serde_json::Map::new();
            for (i, shard) in shards.iter().enumerate() {
                let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
                for k in shard.keys() {
                    weight_map.insert(k.clone(), serde_json::json!(file));
                }
                let p = tmp.join(&file);
                candle_core::safetensors::save(shard, &p)?;
                hasher.update(std::fs::read(&p).map_err(Error::io("reading", &p))?);
            }
            let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
            let p = tmp.join("model.safetensors.index.json");
            std::fs::write(&p, serde_json::to_string_pretty(&index).unwrap_or_default())
                .map_err(Error::io("writing", &p))?;
        }
    }
    let mut hf = hf.clone();
    hf.extra
        .insert("architectures".into(), serde_json::json!([architecture(&hf)]));
    let dtype = tensors_dtype(vars)?;
    hf.extra.insert("torch_dtype".into(), serde_json::json!(dtype));
    let p = tmp.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&hf).unwrap_or_default()).map_err(Error::io("writing", &p))?;
    if let Some(t) = tokenizer {
        t.save(&tmp.join("tokenizer.json"))?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(Error::io("replacing", dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(Error::io("renaming into", dir))?;
    Ok(hex::encode(hasher.finalize()))
}

/// The `torch_dtype` name of the variables' dtype (`float32` unless every one is bf16).
fn tensors_dtype(vars: &VarMap) -> Result<&'static str> {
    let data = vars
        .data()
        .lock()
        .map_err(|_| Error::Shape("var map lock poisoned".into()))?;
    Ok(if !data.is_empty() && data.values().all(|v| v.dtype() == DType::BF16) {
        "bfloat16"
    } else {
        "float32"
    })
}

fn architecture(hf: &HfConfig) -> &'static str {
    match hf.model_type.as_deref() {
        Some("qwen2") => "Qwen2ForCausalLM",
        Some("qwen3") => "Qwen3ForCausalLM",
        Some("qwen3_moe") => "Qwen3MoeForCausalLM",
        Some("mixtral") => "MixtralForCausalLM",
        _ => "LlamaForCausalLM",
    }
}

fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index)
        .map_err(|_| Error::checkpoint(dir, "neither model.safetensors nor model.safetensors.index.json"))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
        path: index.display().to_string(),
        reason: e.to_string(),
    })?;
    let mut files: Vec<String> = v["weight_map"]
        .as_object()
        .ok_or_else(|| Error::checkpoint(&index, "no weight_map"))?
        .values()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect();
    files.sort();
    files.dedup();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// Loads a checkpoint directory onto `device` as trainable f32 variables. Every weight the
/// model needs must be present with the right shape; all problems are reported at once.
pub fn load(dir: &Path, device: &Device) -> Result<Loaded> {
    load_as(dir, device, DType::F32)
}

/// [`load`] for a model that computes in `precision` on `device`: weights in
/// [`Precision::weights`]'s dtype and the products [`Precision::products`] says.
///
/// [`Precision::weights`]: crate::device::Precision::weights
/// [`Precision::products`]: crate::device::Precision::products
pub fn load_in(dir: &Path, device: &Device, precision: crate::device::Precision) -> Result<Loaded> {
    let mut l = load_as(dir, device, precision.weights(device))?;
    l.model.set_products(precision.products(device));
    Ok(l)
}

/// [`load`] into variables of `dtype` (f32 or bf16), whatever dtype the files hold.
pub fn load_as(dir: &Path, device: &Device, dtype: DType) -> Result<Loaded> {
    let hf = HfConfig::load(&dir.join("config.json"))?;
    let mut loaded = init_as(&hf, device, dtype, None)?;
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    for f in weight_files(dir)? {
        weights.extend(candle_core::safetensors::load(&f, device)?);
    }
    let mut problems = Vec::new();
    {
        let data = loaded
            .vars
            .data()
            .lock()
            .map_err(|_| Error::Shape("var map lock poisoned".into()))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let var = &data[name];
            match weights.get(name.as_str()) {
                None => problems.push(format!("missing `{name}` {:?}", var.dims())),
                Some(t) if t.dims() != var.dims() => {
                    problems.push(format!("`{name}` is {:?}, the model needs {:?}", t.dims(), var.dims()))
                }
                Some(t) => var.set(&t.to_dtype(dtype)?)?,
            }
        }
        // A tensor the model does not use means the checkpoint computes something this
        // model would not (biases, extra norms, another architecture): refuse it. Two are
        // harmless: RoPE tables some writers store, and a tied head's copy of the
        // embedding.
        let mut unused: Vec<&String> = weights
            .keys()
            .filter(|k| !data.contains_key(k.as_str()))
            .filter(|k| !k.ends_with("rotary_emb.inv_freq"))
            .filter(|k| !(loaded.config.tie_embeddings && k.as_str() == "lm_head.weight"))
            .collect();
        unused.sort();
        if !unused.is_empty() {
            let shown: Vec<String> = unused.iter().take(8).map(|k| format!("`{k}`")).collect();
            problems.push(format!(
                "{} tensor(s) the {:?} model does not use: {}{}",
                unused.len(),
                loaded.config.family,
                shown.join(", "),
                if unused.len() > 8 { ", …" } else { "" }
            ));
        }
    }
    if !problems.is_empty() {
        return Err(Error::checkpoint(dir, problems.join("; ")));
    }
    let tok = dir.join("tokenizer.json");
    loaded.tokenizer = if tok.exists() {
        Some(Tokenizer::from_file(&tok)?)
    } else {
        None
    };
    Ok(loaded)
}

/// SHA-256 of a checkpoint's weight files (in name order), hex.
pub fn weights_sha256(dir: &Path) -> Result<String> {
    let mut h = Sha256::new();
    for f in weight_files(dir)? {
        h.update(std::fs::read(&f).map_err(Error::io("reading", &f))?);
    }
    Ok(hex::encode(h.finalize()))
}
