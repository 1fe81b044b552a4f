//! Policy weights between processes without a shared disk.
//!
//! The trainer can serve its checkpoints over HTTP ([`CheckpointServer`]):
//! `GET /checkpoints/<version>/manifest.json` lists the files a reader needs with their
//! sizes and SHA-256, `GET /checkpoints/<version>/<file>` streams one. Its `policy` rows
//! then carry `http://host:port/checkpoints/<version>`; readers [`fetch`] such a URI into a
//! local cache (each file checked against the manifest, written under a temporary name
//! and renamed whole) and load the directory as they load a `file://` one, whose weights
//! hash the `policy` row also carries. `file://` paths stay the single-host default and
//! [`fetch`] returns them as they are.
//!
//! ```no_run
//! # async fn demo() -> Result<(), String> {
//! let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
//! let server = streamrl_stages::weights::CheckpointServer::start(listener, "run/checkpoints".into(), "run/sft".into())
//!     .map_err(|e| e.to_string())?;
//! let uri = format!("{}/checkpoints/0", server.base_url());
//! let dir = streamrl_stages::weights::fetch(&reqwest::Client::new(), &uri, std::path::Path::new("/tmp/cache")).await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One file of a served checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Hex SHA-256 of its bytes.
    pub sha256: String,
}

/// What `GET /checkpoints/<version>/manifest.json` returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Policy version.
    pub version: u64,
    /// The files a reader needs (not the optimizer's or the trainer's state).
    pub files: Vec<ManifestFile>,
}

/// Whether a reader needs `name` (and so whether it is served): not the optimizer state,
/// not the trainer's bookkeeping, no hidden or temporary files.
fn served(name: &str) -> bool {
    !name.starts_with('.')
        && !name.starts_with("optimizer.")
        && name != "trainer_state.json"
        && !name.ends_with(".tmp")
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

struct Shared {
    store: PathBuf,
    initial: PathBuf,
    manifests: Mutex<HashMap<u64, Arc<Manifest>>>,
}

impl Shared {
    /// The directory of `version`: `<store>/step-NNNNNN`, or the initial checkpoint for 0.
    fn dir(&self, version: u64) -> Option<PathBuf> {
        let d = self.store.join(format!("step-{version:06}"));
        if d.is_dir() {
            Some(d)
        } else if version == 0 && self.initial.is_dir() {
            Some(self.initial.clone())
        } else {
            None
        }
    }
}

/// The trainer's checkpoint server. Dropped, it keeps serving for [`LINGER`] (or until
/// the runtime or the process ends): the trainer finishes as soon as it has published its
/// last version, and readers are still downloading that version then.
#[derive(Debug)]
pub struct CheckpointServer {
    addr: SocketAddr,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// How long a dropped [`CheckpointServer`] goes on serving.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(30);

impl Drop for CheckpointServer {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    tokio::time::sleep(LINGER).await;
                    task.abort();
                });
            }
            Err(_) => task.abort(),
        }
    }
}

impl CheckpointServer {
    /// Serves the versions under `store` (`step-NNNNNN` directories) and `initial` as
    /// version 0, on an already bound `listener` (bind it first to learn a port-0 address
    /// before the runtime runs). Must be called inside a tokio runtime.
    pub fn start(listener: std::net::TcpListener, store: PathBuf, initial: PathBuf) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store,
            initial,
            manifests: Mutex::new(HashMap::new()),
        });
        let app = Router::new()
            .route("/checkpoints/{version}/{file}", get(file))
            .with_state(shared);
        // Small responses (the manifest) must not wait on Nagle + delayed ACKs (~40 ms each).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "checkpoint server stopped");
            }
        });
        Ok(CheckpointServer { addr, task: Some(task) })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

fn not_found(message: String) -> Response {
    failure((StatusCode::NOT_FOUND, message))
}

fn failure((status, message): (StatusCode, String)) -> Response {
    (status, axum::Json(serde_json::json!({"error": message}))).into_response()
}

/// The manifest of `version`, computed once (a published checkpoint never changes).
fn manifest(s: &Shared, version: u64) -> Result<Arc<Manifest>, (StatusCode, String)> {
    if let Some(m) = s.manifests.lock().ok().and_then(|m| m.get(&version).cloned()) {
        return Ok(m);
    }
    let Some(dir) = s.dir(version) else {
        return Err((
            StatusCode::NOT_FOUND,
            format!("version {version} is not kept here (only the newest `keep_last` checkpoints are)"),
        ));
    };
    let io = |e: std::io::Error| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading {}: {e}", dir.display()),
        )
    };
    let mut files = Vec::new();
    for e in std::fs::read_dir(&dir).map_err(io)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let meta = std::fs::symlink_metadata(e.path()).map_err(io)?;
        if !meta.is_file() || !served(&name) {
            continue;
        }
        let bytes = std::fs::read(e.path()).map_err(io)?;
        files.push(ManifestFile {
            name,
            size: bytes.len() as u64,
            sha256: hex::encode(Sha256::digest(&bytes)),
        });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    let m = Arc::new(Manifest { version, files });
    if let Ok(mut all) = s.manifests.lock() {
        // Versions no longer on disk are forgotten.
        all.retain(|v, _| s.dir(*v).is_some());
        all.insert(version, m.clone());
    }
    Ok(m)
}

async fn file(State(s): State<Arc<Shared>>, UrlPath((version, name)): UrlPath<(String, String)>) -> Response {
    let Ok(version) = version.parse::<u64>() else {
        return not_found(format!("`{version}` is not a version number"));
    };
    let s2 = s.clone();
    let m = match tokio::task::spawn_blocking(move || manifest(&s2, version)).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => return failure(e),
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    if name == "manifest.json" {
        return axum::Json(m.as_ref().clone()).into_response();
    }
    // Only names the manifest lists: no path can leave the checkpoint directory.
    let Some(entry) = m.files.iter().find(|f| f.name == name) else {
        return not_found(format!("version {version} has no served file `{name}`"));
    };
    let Some(dir) = s.dir(version) else {
        return not_found(format!("version {version} was deleted"));
    };
    // The length is the file's own: a file that changed since its manifest is sent as it
    // is now, and the reader's check against the manifest refuses it.
    let opened = match tokio::fs::File::open(dir.join(&entry.name)).await {
        Ok(f) => f.metadata().await.map(|m| (f, m.len())),
        Err(e) => Err(e),
    };
    match opened {
        Ok((f, len)) => {
            let stream = futures::stream::unfold(f, |mut f| async move {
                let mut buf = vec![0u8; 1 << 20];
                match tokio::io::AsyncReadExt::read(&mut f, &mut buf).await {
                    Ok(0) => None,
                    Ok(n) => {
                        buf.truncate(n);
                        Some((Ok::<_, std::io::Error>(buf), f))
                    }
                    Err(e) => Some((Err(e), f)),
                }
            });
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (header::CONTENT_LENGTH, len.to_string()),
                ],
                Body::from_stream(stream),
            )
                .into_response()
        }
        Err(e) => not_found(format!("version {version}: {e}")),
    }
}

/// A local directory holding the checkpoint at `uri`: a `file://` URI or plain path as it
/// is; an `http://…/checkpoints/<version>` URI downloaded under `cache` (once: a complete
/// copy is reused), every file checked against the manifest's size and SHA-256. Older
/// cached versions are removed, so the cache holds at most two.
pub async fn fetch(client: &reqwest::Client, uri: &str, cache: &Path) -> Result<PathBuf, String> {
    if !uri.starts_with("http://") && !uri.starts_with("https://") {
        return Ok(crate::uri_path(uri));
    }
    let base = uri.trim_end_matches('/');
    let get = |url: String| async move {
        let r = client.get(&url).send().await.map_err(|e| format!("GET {url}: {e}"))?;
        if !r.status().is_success() {
            let status = r.status();
            let body = r.text().await.unwrap_or_default();
            return Err(format!("GET {url}: {status}: {body}"));
        }
        Ok((url, r))
    };
    let (url, r) = get(format!("{base}/manifest.json")).await?;
    let bytes = r.bytes().await.map_err(|e| format!("GET {url}: {e}"))?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| format!("GET {url}: not a manifest: {e}"))?;
    if m.files.iter().any(|f| !served(&f.name)) {
        return Err(format!("GET {url}: the manifest names a file a reader must not write"));
    }
    let key = hex::encode(Sha256::digest(&bytes));
    let dir = cache.join(format!("v{:06}-{}", m.version, &key[..16]));
    if dir.join(".complete").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    let tmp = cache.join(format!(".v{:06}-{}.tmp", m.version, rand::random::<u32>()));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    let result = async {
        for f in &m.files {
            let (url, mut r) = get(format!("{base}/{}", f.name)).await?;
            let mut h = Sha256::new();
            let mut out = Vec::with_capacity(f.size as usize);
            while let Some(chunk) = r.chunk().await.map_err(|e| format!("GET {url}: {e}"))? {
                h.update(&chunk);
                out.extend_from_slice(&chunk);
            }
            let sha = hex::encode(h.finalize());
            if out.len() as u64 != f.size || sha != f.sha256 {
                return Err(format!(
                    "GET {url}: got {} bytes with sha256 {sha}, the manifest says {} bytes with {}",
                    out.len(),
                    f.size,
                    f.sha256
                ));
            }
            std::fs::write(tmp.join(&f.name), out).map_err(|e| format!("writing {}: {e}", f.name))?;
        }
        std::fs::write(tmp.join(".complete"), b"").map_err(|e| e.to_string())?;
        Ok(())
    }
    .await;
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => {}
        // Another fetch of the same version won the race: use its copy.
        Err(_) if dir.join(".complete").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(e) => return Err(format!("renaming into {}: {e}", dir.display())),
    }
    prune(cache, &dir);
    Ok(dir)
}

/// How long [`initial`] waits for a checkpoint server that does not answer yet.
pub const INITIAL_WAIT: Duration = Duration::from_secs(300);

/// The local directory of a stage's initial checkpoint (`checkpoint:` in its config): a
/// path as it is; an `http://…/checkpoints/<version>` URI (a trainer's
/// [`CheckpointServer`], e.g. `http://trainer:8400/checkpoints/0` under compose) fetched
/// into `cache` as [`fetch`] does. The trainer may still be starting when the stage is built
/// (every service of a `docker compose up` starts together), so a failed fetch is retried
/// every second for up to `wait`, each failure logged, and the last one is returned.
/// Blocking: it runs on a thread of its own, inside a tokio runtime or not.
pub fn initial(checkpoint: &Path, cache: &Path, wait: Duration) -> Result<PathBuf, String> {
    let uri = checkpoint.to_string_lossy().into_owned();
    if !uri.starts_with("http://") && !uri.starts_with("https://") {
        return Ok(checkpoint.to_path_buf());
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("starting a runtime to fetch {uri}: {e}"))?;
            rt.block_on(async {
                let client = reqwest::Client::new();
                let deadline = std::time::Instant::now() + wait;
                loop {
                    match fetch(&client, &uri, cache).await {
                        Ok(dir) => return Ok(dir),
                        Err(e) if std::time::Instant::now() < deadline => {
                            tracing::info!(%uri, error = %e, "initial checkpoint not fetched yet; retrying in 1 s");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => return Err(format!("{e} (still failing after {} s)", wait.as_secs())),
                    }
                }
            })
        })
        .join()
        .unwrap_or_else(|_| Err(format!("fetching {uri} panicked")))
    })
}

/// Removes cached versions other than `keep` and the newest one before it.
fn prune(cache: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(cache) else { return };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('v')) && p != keep)
        .collect();
    dirs.sort();
    dirs.pop();
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(dir: &Path, tag: &str) {
        std::fs::create_dir_all(dir).unwrap();
        for (name, body) in [
            ("config.json", format!("{{\"tag\": \"{tag}\"}}")),
            ("model.safetensors", tag.repeat(300_000)),
            ("tokenizer.json", "{}".into()),
            ("optimizer.safetensors", "secret".into()),
            ("trainer_state.json", "{}".into()),
        ] {
            std::fs::write(dir.join(name), body).unwrap();
        }
    }

    /// A server over `<root>/store` (version 3 tagged "b") and the initial policy
    /// `<root>/sft` (tagged "a"), with a file beside them; the cache directory.
    fn served(root: &Path) -> (CheckpointServer, PathBuf) {
        let (store, initial) = (root.join("store"), root.join("sft"));
        checkpoint(&initial, "a");
        checkpoint(&store.join("step-000003"), "b");
        std::fs::write(root.join("outside.txt"), "no").unwrap();
        let server =
            CheckpointServer::start(std::net::TcpListener::bind("127.0.0.1:0").unwrap(), store, initial).unwrap();
        (server, root.join("cache"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn served_checkpoints_are_fetched_once_without_the_trainers_state() {
        let root = tempfile::tempdir().unwrap();
        let (server, cache) = served(root.path());
        let client = reqwest::Client::new();
        let base = server.base_url();
        for (version, tag) in [(0, "a"), (3, "b")] {
            let dir = fetch(&client, &format!("{base}/checkpoints/{version}"), &cache)
                .await
                .unwrap();
            let src = if version == 0 {
                root.path().join("sft")
            } else {
                root.path().join("store/step-000003")
            };
            for f in ["config.json", "model.safetensors", "tokenizer.json"] {
                assert_eq!(
                    std::fs::read(dir.join(f)).unwrap(),
                    std::fs::read(src.join(f)).unwrap(),
                    "{f}"
                );
            }
            // The trainer's own state is not served.
            assert!(!dir.join("optimizer.safetensors").exists() && !dir.join("trainer_state.json").exists());
            assert!(std::fs::read_to_string(dir.join("config.json")).unwrap().contains(tag));
            // A second fetch reuses the complete copy.
            assert_eq!(
                fetch(&client, &format!("{base}/checkpoints/{version}/"), &cache)
                    .await
                    .unwrap(),
                dir
            );
        }
        // file:// URIs are local paths.
        assert_eq!(
            fetch(&client, "file:///x/y", &cache).await.unwrap(),
            PathBuf::from("/x/y")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn served_checkpoints_are_confined_to_their_directory() {
        let root = tempfile::tempdir().unwrap();
        let (server, cache) = served(root.path());
        let client = reqwest::Client::new();
        let base = server.base_url();
        // Unknown versions and names, and every way out of the directory, are 404s.
        for path in [
            "/checkpoints/7/config.json",
            "/checkpoints/x/config.json",
            "/checkpoints/3/optimizer.safetensors",
            "/checkpoints/3/trainer_state.json",
            "/checkpoints/3/..%2F..%2Foutside.txt",
            "/checkpoints/3/%2E%2E",
            "/checkpoints/3/../../outside.txt",
        ] {
            let status = client.get(format!("{base}{path}")).send().await.unwrap().status();
            assert_eq!(status.as_u16(), 404, "{path}");
        }
        let err = fetch(&client, &format!("{base}/checkpoints/7"), &cache)
            .await
            .unwrap_err();
        assert!(err.contains("404") && err.contains("keep_last"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_changed_after_its_manifest_is_refused_and_leaves_nothing() {
        let root = tempfile::tempdir().unwrap();
        let (server, cache) = served(root.path());
        let client = reqwest::Client::new();
        let base = server.base_url();
        fetch(&client, &format!("{base}/checkpoints/0"), &cache).await.unwrap();
        fetch(&client, &format!("{base}/checkpoints/3"), &cache).await.unwrap();
        // A file that changed after its manifest was computed is refused, and nothing
        // partial is left in the cache.
        let store = root.path().join("store");
        checkpoint(&store.join("step-000004"), "c");
        let _ = client
            .get(format!("{base}/checkpoints/4/manifest.json"))
            .send()
            .await
            .unwrap();
        std::fs::write(store.join("step-000004/model.safetensors"), "tampered").unwrap();
        let err = fetch(&client, &format!("{base}/checkpoints/4"), &cache)
            .await
            .unwrap_err();
        assert!(
            err.contains("model.safetensors") && err.contains("the manifest says"),
            "{err}"
        );
        let left: Vec<String> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.iter().all(|n| n.starts_with("v00000")), "{left:?}");
        assert_eq!(left.len(), 2, "at most two versions cached: {left:?}");
    }
}
