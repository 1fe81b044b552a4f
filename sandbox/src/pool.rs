//! A warm pool: sandboxes are started ahead of time by a background thread, so an exec
//! pays only for its command. Each one-shot exec gets a fresh or freshly reset sandbox
//! (nothing carries over between executions): the init resets it right after the
//! command, in the same round trip, and it is reused up to `reuse` times, then destroyed
//! off the caller's path. Sessions keep theirs.

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
    /// Sandboxes out running one-shot commands; they come back to be reused.
    lent: usize,
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
    /// Sandboxes reset and put back for another command.
    pub reused: u64,
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
        self.take_inner(false)
    }

    fn take_inner(&self, lend: bool) -> Result<Sandbox, Error> {
        let warm = {
            let mut st = self.inner.state.lock().expect("pool lock");
            st.lent += lend as usize;
            st.ready.pop_front()
        };
        self.inner.cv.notify_all();
        if let Some(s) = warm {
            return Ok(s);
        }
        self.inner.state.lock().expect("pool lock").stats.cold_starts += 1;
        Sandbox::start(&self.inner.cfg)
    }

    /// Hands a used sandbox to the background thread to be destroyed off the caller's
    /// path.
    pub fn retire(&self, s: Sandbox) {
        self.inner.state.lock().expect("pool lock").retire.push(s);
        self.inner.cv.notify_all();
    }

    /// Hands a sandbox that ran one-shot commands back: ready at once when it was reset
    /// with its command (it has uses left, `reuse`), else destroyed on the background
    /// thread.
    fn done_with(&self, s: Sandbox, healthy: bool, reset: bool) {
        let mut st = self.inner.state.lock().expect("pool lock");
        st.lent -= 1;
        if healthy && reset && s.is_usable() && st.ready.len() < self.inner.cfg.pool_size {
            st.stats.reused += 1;
            st.ready.push_back(s);
        } else {
            st.retire.push(s);
        }
        drop(st);
        self.inner.cv.notify_all();
    }

    /// Runs one command in a fresh (or freshly reset) sandbox, blocking. Sandbox failures
    /// come back as an `internal_error` result.
    pub fn exec(&self, req: &ExecRequest) -> ExecResult {
        self.exec_with_files(&[], req)
    }

    /// Writes `files` into a fresh sandbox's `/work`, then runs one command there.
    pub fn exec_with_files(&self, files: &[(&str, &[u8])], req: &ExecRequest) -> ExecResult {
        let mut s = match self.take_inner(true) {
            Ok(s) => s,
            Err(e) => {
                self.inner.state.lock().expect("pool lock").lent -= 1;
                self.inner.cv.notify_all();
                return ExecResult::internal_error(e.to_string());
            }
        };
        let mut r = None;
        for (path, data) in files {
            if let Err(e) = s.write_file(path, data, 0o644) {
                r = Some(ExecResult::internal_error(e.to_string()));
                break;
            }
        }
        // Reset with the command when the sandbox will serve another: one round trip, and
        // it is ready again as soon as the answer is in.
        let reset = s.uses() + 1 < self.inner.cfg.reuse;
        let r = r.unwrap_or_else(|| if reset { s.exec_then_reset(req) } else { s.exec(req) });
        self.done_with(s, r.status != crate::ExecStatus::InternalError, reset);
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
            while !st.shutdown && st.ready.len() + st.lent >= inner.cfg.pool_size && st.retire.is_empty() {
                st = inner.cv.wait(st).expect("pool lock");
            }
            if st.shutdown {
                let st = &mut *st;
                let retire: Vec<Sandbox> = st.retire.drain(..).chain(st.ready.drain(..)).collect();
                drop(retire);
                return;
            }
            (
                st.ready.len() + st.lent < inner.cfg.pool_size,
                std::mem::take(&mut st.retire),
            )
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
