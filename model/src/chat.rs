//! Chat templates: render messages into a prompt with the checkpoint's own template (the
//! Jinja `chat_template` of `tokenizer_config.json`, rendered with minijinja as Hugging Face
//! `apply_chat_template` does), or with the built-in plain template for synthetic tasks
//! (the message contents joined by newlines, so a single user message is exactly its text —
//! what the environments' plain prompts are).
//!
//! ```
//! use streamrl_model::chat::{ChatMessage, ChatTemplate};
//!
//! let t = ChatTemplate::from_jinja(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
//!     None, None,
//! ).unwrap();
//! let m = [ChatMessage { role: "user".into(), content: "2+2=".into() }];
//! assert_eq!(t.render(&m, true).unwrap(), "<|user|>2+2=\n<|assistant|>");
//! assert_eq!(ChatTemplate::Plain.render(&m, true).unwrap(), "2+2=");
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// system, user, assistant or tool.
    pub role: String,
    /// Text.
    pub content: String,
}

/// How messages become a prompt.
#[derive(Debug, Clone)]
pub enum ChatTemplate {
    /// The message contents joined by newlines.
    Plain,
    /// A Jinja template (Hugging Face `chat_template`).
    Jinja {
        /// Template source.
        source: String,
        /// `bos_token` as the template sees it.
        bos: String,
        /// `eos_token` as the template sees it.
        eos: String,
    },
}

fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// A Jinja template, checked for syntax now.
    pub fn from_jinja(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.add_template("chat", source)
            .map_err(|e| Error::Tokenizer(format!("chat template does not parse: {e}")))?;
        Ok(ChatTemplate::Jinja {
            source: source.to_string(),
            bos: bos.unwrap_or_default().to_string(),
            eos: eos.unwrap_or_default().to_string(),
        })
    }

    /// The checkpoint's template from `tokenizer_config.json`, or [`ChatTemplate::Plain`]
    /// when it has none.
    pub fn for_checkpoint(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(ChatTemplate::Plain);
        }
        let text = std::fs::read_to_string(&path).map_err(Error::io("reading", &path))?;
        let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let source = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            // A list of named templates: take "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .unwrap_or_default()
                .to_string(),
            _ => return Ok(ChatTemplate::Plain),
        };
        let bos = token_text(cfg.get("bos_token"));
        let eos = token_text(cfg.get("eos_token"));
        Self::from_jinja(&source, Some(&bos), Some(&eos))
    }

    /// Renders `messages`; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        match self {
            ChatTemplate::Plain => Ok(messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n")),
            ChatTemplate::Jinja { source, bos, eos } => {
                let mut env = minijinja::Environment::new();
                env.add_function(
                    "raise_exception",
                    |msg: String| -> std::result::Result<String, minijinja::Error> {
                        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
                    },
                );
                env.add_template("chat", source)
                    .map_err(|e| Error::Tokenizer(format!("chat template does not parse: {e}")))?;
                let t = env.get_template("chat").map_err(|e| Error::Tokenizer(e.to_string()))?;
                t.render(minijinja::context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => bos,
                    eos_token => eos,
                })
                .map_err(|e| Error::Tokenizer(format!("rendering the chat template: {e}")))
            }
        }
    }
}
