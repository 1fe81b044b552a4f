//! The sandbox stage's remote executor: executions sent to a fleet of sandbox gateways
//! (`streamrl sandbox serve`), found by name, instead of the stage's own pool.
//!
//! * **Endpoints.** `dns://NAME:PORT` stands for every address NAME resolves to (what a
//!   Kubernetes headless service or Docker's service DNS gives: one A record per
//!   replica), resolved again every `resolve_every_secs`; `http://HOST:PORT` is one
//!   gateway. An address that leaves the name gets no new work (what it runs finishes).
//! * **Routing.** Each execution goes to the gateway with the fewest executions in flight
//!   (ties: the one that has served fewer). A gateway holds at most `per_gateway` at once;
//!   when every gateway is full the stage waits for a free one (backpressure: it stops
//!   taking input), it never queues without bound.
//! * **Failures.** A request that fails (connection refused or reset, a 5xx, no answer
//!   within the execution's wall limit plus `request_timeout_secs`) is sent again to
//!   another gateway, up to `attempts` in all, and the gateway that failed gets no work for
//!   `down_secs`. The stage keeps one result per rollout (the first that arrives), so a
//!   retry can never be scored twice. A 4xx (a wrong token, a refused request) is not
//!   retried: it becomes the execution's `internal_error` with the gateway's message.
//! * **Tool calls** run as one-shot executions, as on the local pool (each call carries
//!   the code it runs; no state lives in a gateway between calls), so any gateway can run
//!   any turn.
//!
//! The bearer token comes from the environment variable `token_env` or the first line of
//! `token_file`, never from the topology.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;
use streamrl_envs::Execution;
use streamrl_sandbox::{ExecResult, Limits};

use crate::Invalid;

/// Where the gateways are and how the stage talks to them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaysConfig {
    /// `dns://NAME:PORT` (every address of NAME) or `http://HOST:PORT` entries.
    pub endpoints: Vec<String>,
    /// Environment variable holding the bearer token.
    pub token_env: String,
    /// File whose first line is the bearer token (read instead of `token_env`).
    pub token_file: Option<PathBuf>,
    /// Executions in flight on one gateway at most.
    pub per_gateway: usize,
    /// Seconds a request may take beyond the execution's wall-clock limit before it is
    /// given up and sent elsewhere.
    pub request_timeout_secs: f64,
    /// Tries per execution, over different gateways where there are several.
    pub attempts: u32,
    /// Seconds a gateway that failed a request gets no new work.
    pub down_secs: f64,
    /// Seconds between two resolutions of the `dns://` names.
    pub resolve_every_secs: f64,
}

impl Default for GatewaysConfig {
    fn default() -> Self {
        GatewaysConfig {
            endpoints: Vec::new(),
            token_env: "STREAMRL_SANDBOX_TOKEN".into(),
            token_file: None,
            per_gateway: 16,
            request_timeout_secs: 10.0,
            attempts: 4,
            down_secs: 2.0,
            resolve_every_secs: 5.0,
        }
    }
}

impl GatewaysConfig {
    /// Every problem, each naming its field (`gateways.…`).
    pub fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if self.endpoints.is_empty() {
            p.push(Invalid::new(
                "gateways.endpoints",
                "lists no gateway (dns://NAME:PORT or http://HOST:PORT)",
            ));
        }
        for e in &self.endpoints {
            if let Err(why) = Endpoint::parse(e) {
                p.push(Invalid::new("gateways.endpoints", why));
            }
        }
        if self.per_gateway == 0 {
            p.push(Invalid::new("gateways.per_gateway", "must be at least 1"));
        }
        if self.attempts == 0 {
            p.push(Invalid::new("gateways.attempts", "must be at least 1"));
        }
        for (name, v) in [
            ("request_timeout_secs", self.request_timeout_secs),
            ("down_secs", self.down_secs),
            ("resolve_every_secs", self.resolve_every_secs),
        ] {
            if !(v.is_finite() && v > 0.0) {
                p.push(Invalid::new(
                    format!("gateways.{name}"),
                    format!("must be a positive number of seconds, not {v}"),
                ));
            }
        }
        if self.token_file.is_none() && self.token_env.is_empty() {
            p.push(Invalid::new(
                "gateways.token_env",
                "names no variable and no token_file is given",
            ));
        }
        p
    }

    /// The bearer token, from `token_file` or `token_env`.
    pub fn token(&self) -> Result<String, String> {
        let token = match &self.token_file {
            Some(f) => std::fs::read_to_string(f)
                .map_err(|e| format!("reading the gateways' token file {}: {e}", f.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_string(),
            None => std::env::var(&self.token_env).map_err(|_| {
                format!(
                    "the gateways' bearer token: environment variable {} is not set",
                    self.token_env
                )
            })?,
        };
        if token.is_empty() {
            return Err("the gateways' bearer token is empty".into());
        }
        Ok(token)
    }
}

/// One configured endpoint.
#[derive(Debug, Clone, PartialEq)]
enum Endpoint {
    /// Every address of `host`, on `port`.
    Dns { host: String, port: u16 },
    /// One gateway at this base URL.
    Url(String),
}

impl Endpoint {
    fn parse(s: &str) -> Result<Endpoint, String> {
        if let Some(rest) = s.strip_prefix("dns://") {
            let (host, port) = rest
                .trim_end_matches('/')
                .rsplit_once(':')
                .ok_or_else(|| format!("`{s}`: a dns:// endpoint is dns://NAME:PORT"))?;
            let port = port
                .parse()
                .map_err(|_| format!("`{s}`: `{port}` is not a port number"))?;
            if host.is_empty() {
                return Err(format!("`{s}`: no name before the port"));
            }
            Ok(Endpoint::Dns {
                host: host.into(),
                port,
            })
        } else if s.starts_with("http://") || s.starts_with("https://") {
            Ok(Endpoint::Url(s.trim_end_matches('/').into()))
        } else {
            Err(format!("`{s}` is neither dns://NAME:PORT nor http://HOST:PORT"))
        }
    }
}

/// One gateway as the stage sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GatewayStats {
    /// Its base URL.
    pub url: String,
    /// Executions it answered.
    pub served: u64,
    /// Requests to it that failed (and were sent elsewhere).
    pub failed: u64,
    /// Whether its name (or the static list) still gives it.
    pub listed: bool,
}

#[derive(Debug)]
struct Gateway {
    url: String,
    in_flight: usize,
    served: u64,
    failed: u64,
    listed: bool,
    down_until: Option<Instant>,
}

#[derive(Debug, Default)]
struct State {
    gateways: Vec<Gateway>,
    resolved_at: Option<Instant>,
}

/// The fleet of gateways: resolution, routing, retries.
#[derive(Debug)]
pub struct Fleet {
    cfg: GatewaysConfig,
    endpoints: Vec<Endpoint>,
    token: String,
    client: reqwest::Client,
    state: Mutex<State>,
    freed: tokio::sync::Notify,
}

/// A slot taken on one gateway, given back on drop.
struct Slot<'a> {
    fleet: &'a Fleet,
    url: String,
    outcome: Option<bool>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut st = self.fleet.state.lock().expect("fleet state");
        if let Some(g) = st.gateways.iter_mut().find(|g| g.url == self.url) {
            g.in_flight -= 1;
            match self.outcome {
                Some(true) => g.served += 1,
                Some(false) => {
                    g.failed += 1;
                    g.down_until = Some(Instant::now() + Duration::from_secs_f64(self.fleet.cfg.down_secs));
                }
                None => {}
            }
        }
        // Gateways that left their name are forgotten once nothing runs on them.
        st.gateways.retain(|g| g.listed || g.in_flight > 0);
        drop(st);
        self.fleet.freed.notify_waiters();
    }
}

impl Fleet {
    /// A fleet for `cfg` (checked: [`GatewaysConfig::problems`]); reads the token.
    pub fn new(cfg: GatewaysConfig) -> Result<Fleet, String> {
        let endpoints = cfg
            .endpoints
            .iter()
            .map(|e| Endpoint::parse(e))
            .collect::<Result<Vec<_>, _>>()?;
        let token = cfg.token()?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(Fleet {
            cfg,
            endpoints,
            token,
            client,
            state: Mutex::new(State::default()),
            freed: tokio::sync::Notify::new(),
        })
    }

    /// Every gateway known now, with what it served.
    pub fn stats(&self) -> Vec<GatewayStats> {
        let st = self.state.lock().expect("fleet state");
        st.gateways
            .iter()
            .map(|g| GatewayStats {
                url: g.url.clone(),
                served: g.served,
                failed: g.failed,
                listed: g.listed,
            })
            .collect()
    }

    /// Resolves the endpoints again when the last resolution is older than
    /// `resolve_every_secs` (or `force`).
    async fn refresh(&self, force: bool) {
        let due = {
            let st = self.state.lock().expect("fleet state");
            force
                || st
                    .resolved_at
                    .is_none_or(|t| t.elapsed().as_secs_f64() >= self.cfg.resolve_every_secs)
        };
        if !due {
            return;
        }
        let mut urls = Vec::new();
        let mut problems = Vec::new();
        for e in &self.endpoints {
            match e {
                Endpoint::Url(u) => urls.push(u.clone()),
                Endpoint::Dns { host, port } => match tokio::net::lookup_host((host.as_str(), *port)).await {
                    Ok(addrs) => {
                        let before = urls.len();
                        urls.extend(addrs.map(|a| format!("http://{a}")));
                        if urls.len() == before {
                            problems.push(format!("{host} resolves to no address"));
                        }
                    }
                    Err(err) => problems.push(format!("resolving {host}: {err}")),
                },
            }
        }
        urls.sort();
        urls.dedup();
        if !problems.is_empty() {
            tracing::warn!(problems = %problems.join("; "), "gateway endpoints did not resolve");
        }
        let mut st = self.state.lock().expect("fleet state");
        st.resolved_at = Some(Instant::now());
        if urls.is_empty() && st.gateways.iter().any(|g| g.listed) {
            // A failed lookup is not a fleet that vanished: keep what was known.
            return;
        }
        for g in &mut st.gateways {
            g.listed = urls.contains(&g.url);
        }
        for u in urls {
            if !st.gateways.iter().any(|g| g.url == u) {
                st.gateways.push(Gateway {
                    url: u,
                    in_flight: 0,
                    served: 0,
                    failed: 0,
                    listed: true,
                    down_until: None,
                });
            }
        }
        st.gateways.retain(|g| g.listed || g.in_flight > 0);
        drop(st);
        self.freed.notify_waiters();
    }

    /// A slot on the listed gateway with the fewest executions in flight, other than
    /// `avoid` when another has room; waits while every gateway is full or down.
    async fn slot(&self, avoid: Option<&str>) -> Slot<'_> {
        loop {
            self.refresh(false).await;
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.state.lock().expect("fleet state");
                let now = Instant::now();
                let per = self.cfg.per_gateway;
                let open = |g: &Gateway| g.listed && g.in_flight < per && g.down_until.is_none_or(|t| t <= now);
                let best = |skip: Option<&str>| {
                    st.gateways
                        .iter()
                        .enumerate()
                        .filter(|(_, g)| open(g) && Some(g.url.as_str()) != skip)
                        .min_by_key(|(_, g)| (g.in_flight, g.served + g.failed))
                        .map(|(i, _)| i)
                };
                if let Some(i) = best(avoid).or_else(|| best(None)) {
                    let g = &mut st.gateways[i];
                    g.in_flight += 1;
                    return Slot {
                        fleet: self,
                        url: g.url.clone(),
                        outcome: None,
                    };
                }
            }
            // Full, down or none resolved: wait for a slot to free, or look again soon
            // (a down gateway's time ends, a name gains addresses).
            let _ = tokio::time::timeout(Duration::from_millis(250), notified).await;
            let none = self
                .state
                .lock()
                .expect("fleet state")
                .gateways
                .iter()
                .all(|g| !g.listed);
            if none {
                self.refresh(true).await;
            }
        }
    }

    /// Runs `ex` (with `limits`, its wall limit lowered to the execution's own) on the
    /// fleet; `key` names it in the gateways' logs (the rollout id). Never fails: what
    /// cannot be run is an `internal_error` result naming why.
    pub async fn exec(&self, key: &str, ex: &Execution, limits: &Limits) -> ExecResult {
        let wall_ms = ex.wall_ms.map_or(limits.wall_ms, |w| w.min(limits.wall_ms));
        let files: serde_json::Map<String, serde_json::Value> =
            ex.files.iter().map(|(p, c)| (p.clone(), json!(c))).collect();
        let body = json!({"argv": ex.argv, "files": files, "limits": {"wall_ms": wall_ms}}).to_string();
        let timeout = Duration::from_millis(wall_ms) + Duration::from_secs_f64(self.cfg.request_timeout_secs);
        let mut errors = Vec::new();
        let mut last: Option<String> = None;
        for attempt in 0..self.cfg.attempts {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100 << attempt.min(4))).await;
            }
            let mut slot = self.slot(last.as_deref()).await;
            let sent = self
                .client
                .post(format!("{}/v1/exec", slot.url))
                .bearer_auth(&self.token)
                .header("x-streamrl-execution", key)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.clone())
                .timeout(timeout)
                .send()
                .await;
            let failure = match sent {
                Ok(resp) if resp.status().is_success() => {
                    match resp
                        .bytes()
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|b| serde_json::from_slice::<ExecResult>(&b).map_err(|e| e.to_string()))
                    {
                        Ok(r) => {
                            slot.outcome = Some(true);
                            return r;
                        }
                        Err(e) => format!("{}: unreadable answer: {e}", slot.url),
                    }
                }
                Ok(resp) if resp.status().is_client_error() => {
                    // Refused as asked (a wrong token, a request it will not run): the
                    // same request would be refused by any gateway.
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    slot.outcome = Some(true);
                    return ExecResult::internal_error(format!(
                        "gateway {} refused the execution ({status}): {text}",
                        slot.url
                    ));
                }
                Ok(resp) => format!("{}: {}", slot.url, resp.status()),
                Err(e) if e.is_timeout() => format!("{}: no answer within {:.1} s", slot.url, timeout.as_secs_f64()),
                Err(e) => format!("{}: {e}", slot.url),
            };
            tracing::warn!(execution = key, attempt = attempt + 1, error = %failure, "gateway request failed; trying another");
            slot.outcome = Some(false);
            last = Some(slot.url.clone());
            errors.push(failure);
        }
        ExecResult::internal_error(format!(
            "no gateway ran the execution in {} attempts: {}",
            self.cfg.attempts,
            errors.join("; ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_bad_ones_are_named() {
        assert_eq!(
            Endpoint::parse("dns://sandbox-gateway:8090").unwrap(),
            Endpoint::Dns {
                host: "sandbox-gateway".into(),
                port: 8090
            }
        );
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:9/").unwrap(),
            Endpoint::Url("http://127.0.0.1:9".into())
        );
        let cfg = GatewaysConfig {
            endpoints: vec!["dns://x".into(), "tcp://y:1".into(), "dns://z:port".into()],
            per_gateway: 0,
            down_secs: -1.0,
            ..Default::default()
        };
        let p: Vec<String> = cfg.problems().iter().map(|i| i.to_string()).collect();
        let all = p.join("\n");
        assert!(all.contains("`dns://x`: a dns:// endpoint is dns://NAME:PORT"), "{all}");
        assert!(all.contains("`tcp://y:1` is neither"), "{all}");
        assert!(all.contains("`port` is not a port number"), "{all}");
        assert!(all.contains("per_gateway"), "{all}");
        assert!(all.contains("down_secs"), "{all}");
        assert_eq!(p.len(), 5, "{all}");
    }
}
