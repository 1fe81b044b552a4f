//! A warm pool: sandboxes are started ahead of time by a background thread, so an exec
//! pays only for its command. Each one-shot exec gets a fresh sandbox, which is thrown
//! away afterwards (nothing carries over between executions); sessions keep theirs.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::host::Sandbox;
use crate::protocol::{ExecRequest, ExecResult};
use crate::{Error, SandboxConfig};

#[derive(Debug, Default)]
struct State {
    ready: VecDeque<Sandbox>,
    retire: Vec<Sandbox>,
    shutdown: bool,
    stats: PoolStats,
}

/// Counters of a pool.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Sandboxes started by the background thread.
    pub warm_starts: u64,
    /// Sandboxes started on the caller's thread because none was ready.
    pub cold_starts: u64,
    /// Starts that failed.
    pub start_errors: u64,
    /// The last start error.
    pub last_error: Option<String>,
}

#[derive(Debug)]
struct Inner {
    cfg: SandboxConfig,
    state: Mutex<State>,
    cv: Condvar,
}

/// A pool of ready sandboxes.
///
/// ```no_run
/// use streamrl_sandbox::{ExecRequest, ExecStatus, Pool, SandboxConfig};
///
/// let pool = Pool::new(SandboxConfig::default()).unwrap();
/// let r = pool.exec(&ExecRequest::python("print(6 * 7)"));
/// assert_eq!(r.status, ExecStatus::Ok);
/// assert_eq!(r.stdout, "42\n");
/// ```
#[derive(Debug)]
pub struct Pool {
    inner: Arc<Inner>,
    refill: Option<std::thread::JoinHandle<()>>,
}

impl Pool {
    /// Validates the configuration, starts one sandbox on this thread (so a host that
    /// cannot run sandboxes fails here, with the reason) and starts the refill thread.
    pub fn new(cfg: SandboxConfig) -> Result<Pool, Error> {
        cfg.validate().map_err(Error::Config)?;
        let first = Sandbox::start(&cfg)?;
        let inner = Arc::new(Inner {
            cfg,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        inner.state.lock().expect("pool lock").ready.push_back(first);
        let bg = inner.clone();
        let refill = std::thread::Builder::new()
            .name("sandbox-pool".into())
            .spawn(move || refill_loop(&bg))
            .map_err(|e| Error::Setup(format!("start the pool thread: {e}")))?;
        Ok(Pool {
            inner,
            refill: Some(refill),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SandboxConfig {
        &self.inner.cfg
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        self.inner.state.lock().expect("pool lock").stats.clone()
    }

    /// Sandboxes ready now.
    pub fn ready(&self) -> usize {
        self.inner.state.lock().expect("pool lock").ready.len()
    }

    /// Takes a ready sandbox (or starts one here when none is ready) for the caller to
    /// keep, e.g. as a session; dropping it destroys it.
    pub fn take(&self) -> Result<Sandbox, Error> {
        let warm = {
            let mut st = self.inner.state.lock().expect("pool lock");
            let s = st.ready.pop_front();
            if s.is_none() {
                st.stats.cold_starts += 1;
            }
            s
        };
        self.inner.cv.notify_all();
        match warm {
            Some(s) => Ok(s),
            None => Sandbox::start(&self.inner.cfg),
        }
    }

    /// Hands a used sandbox to the background thread to be destroyed off the caller's
    /// path.
    pub fn retire(&self, s: Sandbox) {
        self.inner.state.lock().expect("pool lock").retire.push(s);
        self.inner.cv.notify_all();
    }

    /// Runs one command in a fresh sandbox (blocking). Sandbox failures come back as an
    /// `internal_error` result.
    pub fn exec(&self, req: &ExecRequest) -> ExecResult {
        match self.take() {
            Ok(mut s) => {
                let r = s.exec(req);
                self.retire(s);
                r
            }
            Err(e) => ExecResult::internal_error(e.to_string()),
        }
    }

    /// Writes `files` into a fresh sandbox's `/work`, then runs one command there.
    pub fn exec_with_files(&self, files: &[(&str, &[u8])], req: &ExecRequest) -> ExecResult {
        let mut s = match self.take() {
            Ok(s) => s,
            Err(e) => return ExecResult::internal_error(e.to_string()),
        };
        for (path, data) in files {
            if let Err(e) = s.write_file(path, data, 0o644) {
                self.retire(s);
                return ExecResult::internal_error(e.to_string());
            }
        }
        let r = s.exec(req);
        self.retire(s);
        r
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.inner.state.lock().expect("pool lock").shutdown = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.refill.take() {
            let _ = t.join();
        }
    }
}

fn refill_loop(inner: &Inner) {
    loop {
        let (need, retire) = {
            let mut st = inner.state.lock().expect("pool lock");
            while !st.shutdown && st.ready.len() >= inner.cfg.pool_size && st.retire.is_empty() {
                st = inner.cv.wait(st).expect("pool lock");
            }
            if st.shutdown {
                let st = &mut *st;
                let retire: Vec<Sandbox> = st.retire.drain(..).chain(st.ready.drain(..)).collect();
                drop(retire);
                return;
            }
            (st.ready.len() < inner.cfg.pool_size, std::mem::take(&mut st.retire))
        };
        drop(retire);
        if need {
            match Sandbox::start(&inner.cfg) {
                Ok(s) => {
                    let mut st = inner.state.lock().expect("pool lock");
                    st.stats.warm_starts += 1;
                    st.ready.push_back(s);
                }
                Err(e) => {
                    {
                        let mut st = inner.state.lock().expect("pool lock");
                        st.stats.start_errors += 1;
                        st.stats.last_error = Some(e.to_string());
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}
