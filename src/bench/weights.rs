//! `streamrl bench weights`: weight-sync time, from a version's publication to every
//! replica serving it, through the trainer's checkpoint server over HTTP (download, check
//! each file, load, swap into a running engine) against `file://` on a shared disk (load,
//! swap) in the same process, for the tiny and small presets and 1 and 4 replicas; then
//! the decode pause a new version costs a serving engine, loaded on its own thread
//! against prepared beside it and installed, for tiny, small and SmolLM2-135M's shape.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, anyhow};
use candle_core::Device;
use streamrl_model::engine::{Engine, EngineConfig};
use streamrl_model::{Tokenizer, checkpoint, config};
use streamrl_stages::weights::{CheckpointServer, fetch};

use super::stats::median;

/// Publication → every replica serving, in ms: each replica loads `location` (fetched
/// first when it is an `http://` URL) as `version`, all at once on their own threads.
fn sync_ms(engines: &mut [Engine], location: &str, version: u32, sha: &str, cache: &Path) -> Result<f64> {
    let rt = tokio::runtime::Handle::current();
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    tokio::task::block_in_place(|| {
        std::thread::scope(|s| {
            let tasks: Vec<_> = engines
                .iter_mut()
                .enumerate()
                .map(|(r, e)| {
                    let (rt, client) = (rt.clone(), client.clone());
                    let cache = cache.join(format!("replica-{r}"));
                    s.spawn(move || -> Result<()> {
                        let dir = rt.block_on(fetch(&client, location, &cache)).map_err(|e| anyhow!(e))?;
                        e.load_weights(&dir, version, Some(sha))?;
                        Ok(())
                    })
                })
                .collect();
            tasks
                .into_iter()
                .try_for_each(|t| t.join().map_err(|_| anyhow!("a replica panicked"))?)
        })
    })?;
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

pub fn run(versions: usize) -> Result<()> {
    println!(
        "streamrl bench weights (profile: {}): publication → every replica serving, median of {versions} versions",
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
    println!();
    println!(
        "{:<8} {:>9} {:>9} {:>14} {:>14} {:>7}",
        "preset", "MB", "replicas", "file:// (ms)", "http:// (ms)", "ratio"
    );
    let tok = Tokenizer::char_level();
    for preset in ["tiny", "small"] {
        let root = tempfile::tempdir()?;
        let (store, init) = (root.path().join("checkpoints"), root.path().join("init"));
        let hf = config::preset(preset, tok.vocab_size())?;
        let loaded = checkpoint::init_seeded(&hf, &Device::Cpu, Some(0))?;
        checkpoint::save(&init, &hf, &loaded.vars, Some(&tok), None)?;
        let server = CheckpointServer::start(std::net::TcpListener::bind("127.0.0.1:0")?, store.clone(), init.clone())?;
        let mb = std::fs::metadata(init.join("model.safetensors"))?.len() as f64 / 1e6;
        let mut version = 0u32;
        for replicas in [1usize, 4] {
            let mut engines = (0..replicas)
                .map(|_| {
                    let m = checkpoint::load(&init, &Device::Cpu)?;
                    Ok(Engine::new(m.model, 0, m.tokenizer, EngineConfig::default()))
                })
                .collect::<Result<Vec<_>>>()?;
            let (mut file, mut http) = (Vec::new(), Vec::new());
            for _ in 0..versions {
                // The trainer's part, not timed: write the version and know its hash.
                version += 1;
                let dir = store.join(format!("step-{version:06}"));
                let sha = checkpoint::save(&dir, &hf, &loaded.vars, Some(&tok), None)?;
                let cache = root.path().join("cache");
                file.push(sync_ms(
                    &mut engines,
                    &format!("file://{}", dir.display()),
                    version,
                    &sha,
                    &cache,
                )?);
                version += 1;
                let dir2 = store.join(format!("step-{version:06}"));
                std::fs::rename(&dir, &dir2)?;
                let url = format!("{}/checkpoints/{version}", server.base_url());
                http.push(sync_ms(&mut engines, &url, version, &sha, &cache)?);
                std::fs::remove_dir_all(&dir2)?;
            }
            let (f, h) = (median(file), median(http));
            println!("{preset:<8} {mb:>9.1} {replicas:>9} {f:>14.1} {h:>14.1} {:>7.2}", h / f);
        }
    }
    println!("  file://: every replica loads the published directory from a shared disk and swaps;");
    println!("  http://: every replica downloads it from the trainer's checkpoint server into its own");
    println!("  cache (each file checked against the manifest), then loads and swaps. One process,");
    println!("  one thread per replica; the weights hash is checked in both.");
    println!();
    pauses(versions)
}

/// The decode pause per new version: the engine loading it on its own thread
/// ([`Engine::load_weights`]: hash, read, lay out, swap; what the rollout stage did until
/// it prepared versions beside decoding) against installing a version a
/// [`WeightLoader`](streamrl_model::engine::WeightLoader) prepared on another thread
/// ([`Engine::install`]). Medians of `versions`.
fn pauses(versions: usize) -> Result<()> {
    println!(
        "{:<8} {:>9} {:>18} {:>18} {:>16} {:>9}",
        "preset", "MB", "load in place (ms)", "prepare beside (ms)", "install (ms)", "ratio"
    );
    for preset in ["tiny", "small", "smollm2"] {
        let vocab = if preset == "smollm2" {
            49152
        } else {
            Tokenizer::char_level().vocab_size()
        };
        let hf = config::preset(preset, vocab)?;
        let root = tempfile::tempdir()?;
        let dir = root.path().join("version");
        let loaded = checkpoint::init_seeded(&hf, &Device::Cpu, Some(0))?;
        let sha = checkpoint::save(&dir, &hf, &loaded.vars, None, None)?;
        let mb = std::fs::metadata(dir.join("model.safetensors"))?.len() as f64 / 1e6;
        let mut engine = Engine::new(loaded.model, 0, None, EngineConfig::default());
        let (mut in_place, mut beside, mut install) = (Vec::new(), Vec::new(), Vec::new());
        for v in 0..versions as u32 {
            let t0 = Instant::now();
            engine.load_weights(&dir, 2 * v + 1, Some(&sha))?;
            in_place.push(t0.elapsed().as_secs_f64() * 1e3);
            let (loader, dir, sha) = (engine.loader(), dir.clone(), sha.clone());
            let t0 = Instant::now();
            let prepared = std::thread::spawn(move || loader.load(&dir, 2 * v + 2, Some(&sha)))
                .join()
                .map_err(|_| anyhow!("the loader panicked"))??;
            beside.push(t0.elapsed().as_secs_f64() * 1e3);
            let t0 = Instant::now();
            engine.install(prepared)?;
            install.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let (a, b, c) = (median(in_place), median(beside), median(install));
        println!("{preset:<8} {mb:>9.1} {a:>18.1} {b:>18.1} {c:>16.3} {:>9.0}", a / c);
    }
    println!("  load in place: the engine hashes, reads and lays out the version itself; decoding");
    println!("  stops meanwhile. prepare beside: the same on another thread while the engine goes on");
    println!("  decoding; install: the decode pause it leaves (a move). ratio: in place / install.");
    Ok(())
}
