//! The engine thread: one [`Engine`] owned by one thread, fed commands over a channel
//! between decode steps; each sequence's events go back to the request that added it.

use std::collections::HashMap;

use streamrl_model::engine::{Engine, Event, Output, Prepared, PromptScores, SamplingParams};
use tokio::sync::mpsc;

/// One generated token as the engine reported it.
pub struct Tok {
    /// The token.
    pub token: u32,
    /// Its logprob.
    pub logprob: f32,
    /// The position's most likely tokens.
    pub top: Vec<(u32, f32)>,
}

/// What a request hears about one of its choices.
pub enum Ev {
    /// A new token.
    Token(Tok),
    /// The choice finished.
    Done(Output),
    /// It failed.
    Error(String),
}

/// One choice to start.
pub struct Add {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// How to sample it.
    pub params: SamplingParams,
    /// Which choice of its request.
    pub index: usize,
    /// Where its events go, tagged with `index`.
    pub events: mpsc::UnboundedSender<(usize, Ev)>,
}

/// What the engine thread is asked to do.
pub enum Cmd {
    /// Start a sequence.
    Add(Add),
    /// Score a prompt (`echo` with `logprobs`).
    Score {
        prompt: Vec<u32>,
        top: usize,
        reply: tokio::sync::oneshot::Sender<Result<PromptScores, String>>,
    },
    /// Swap in weights prepared off this thread, between two steps (an in-flight update:
    /// running sequences go on with the new weights; decoding pauses for the swap alone).
    Install {
        prepared: Box<Prepared>,
        reply: tokio::sync::oneshot::Sender<Result<u32, String>>,
    },
}

/// Each running sequence's choice index and event channel.
type Routes = HashMap<u64, (usize, mpsc::UnboundedSender<(usize, Ev)>)>;

/// The engine loop: admits new requests between steps, routes events, cancels requests
/// whose client went away; returns when every sender is gone.
pub fn engine_loop(mut engine: Engine, rx: std::sync::mpsc::Receiver<Cmd>) {
    let mut routes = Routes::new();
    loop {
        let mut incoming = Vec::new();
        if engine.has_work() {
            while let Ok(a) = rx.try_recv() {
                incoming.push(a);
            }
        } else {
            match rx.recv() {
                Ok(a) => incoming.push(a),
                Err(_) => return,
            }
        }
        let adds = run_commands(&mut engine, incoming);
        if !engine.has_work() && adds.is_empty() {
            continue;
        }
        for a in adds {
            match engine.add(a.prompt, a.params) {
                Ok(id) => {
                    routes.insert(id, (a.index, a.events));
                }
                Err(e) => {
                    let _ = a.events.send((a.index, Ev::Error(e.to_string())));
                }
            }
        }
        match engine.step() {
            Ok(events) => route(&mut engine, &mut routes, events),
            Err(e) => {
                for (_, (i, tx)) in routes.drain() {
                    let _ = tx.send((i, Ev::Error(format!("engine step failed: {e}"))));
                }
            }
        }
    }
}

/// Scores prompts and installs weights at once; returns the sequences to add.
fn run_commands(engine: &mut Engine, incoming: Vec<Cmd>) -> Vec<Add> {
    let mut adds = Vec::new();
    for cmd in incoming {
        match cmd {
            Cmd::Add(a) => adds.push(a),
            Cmd::Score { prompt, top, reply } => {
                let _ = reply.send(engine.prompt_logprobs(&prompt, top).map_err(|e| e.to_string()));
            }
            Cmd::Install { prepared, reply } => {
                let r = engine
                    .install(*prepared)
                    .map(|()| engine.version())
                    .map_err(|e| e.to_string());
                let _ = reply.send(r);
            }
        }
    }
    adds
}

/// Sends a step's events to their requests; cancels the sequences nobody listens to.
fn route(engine: &mut Engine, routes: &mut Routes, events: Vec<Event>) {
    let mut gone = Vec::new();
    for e in events {
        match e {
            Event::Token {
                id,
                token,
                logprob,
                top,
                ..
            } => {
                if let Some((i, tx)) = routes.get(&id)
                    && tx.send((*i, Ev::Token(Tok { token, logprob, top }))).is_err()
                {
                    gone.push(id);
                }
            }
            Event::Done(o) => {
                if let Some((i, tx)) = routes.remove(&o.id) {
                    let _ = tx.send((i, Ev::Done(o)));
                }
            }
        }
    }
    for id in gone {
        routes.remove(&id);
        engine.cancel(id);
    }
}
