//! Tokenizers: any Hugging Face `tokenizer.json`, and a built-in character tokenizer for
//! synthetic tasks that is saved as an ordinary `tokenizer.json`, so every code path is the
//! one real models take.

use std::path::Path;
use std::str::FromStr;

use crate::{Error, Result};

/// Special tokens of the character tokenizer, at ids 0..4.
pub const CHAR_SPECIALS: [&str; 4] = ["<pad>", "<bos>", "<eos>", "<unk>"];

/// The Hugging Face file beside `tokenizer.json` with special tokens and the chat template.
pub const CONFIG_FILE: &str = "tokenizer_config.json";

/// A tokenizer with its special ids resolved.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// End-of-sequence id, if the vocabulary has one.
    pub eos: Option<u32>,
    /// Beginning-of-sequence id, if any.
    pub bos: Option<u32>,
    /// `tokenizer_config.json` (special tokens, chat template, tokenizer class), kept as
    /// read and written back beside `tokenizer.json`, so Hugging Face tools load the pair.
    config: serde_json::Map<String, serde_json::Value>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer(vocab {}, eos {:?})", self.vocab_size(), self.eos)
    }
}

impl Tokenizer {
    /// Wraps a `tokenizers` tokenizer, finding its eos/bos among common spellings.
    pub fn new(inner: tokenizers::Tokenizer) -> Self {
        let find = |names: &[&str]| names.iter().find_map(|n| inner.token_to_id(n));
        let eos = find(&["<eos>", "<|im_end|>", "<|endoftext|>", "</s>", "<|end_of_text|>"]);
        let bos = find(&["<bos>", "<s>", "<|begin_of_text|>"]);
        Tokenizer {
            inner,
            eos,
            bos,
            config: serde_json::Map::new(),
        }
    }

    /// The character tokenizer: the specials, then printable ASCII and newline.
    pub fn char_level() -> Self {
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (i, s) in CHAR_SPECIALS.iter().enumerate() {
            vocab.insert(s.to_string(), serde_json::json!(i));
            added.push(
                serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}),
            );
        }
        let chars = std::iter::once('\n').chain((32u8..=126).map(char::from));
        for c in chars {
            let id = vocab.len();
            vocab.insert(c.to_string(), serde_json::json!(id));
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null,
            // One token per character. `[\s\S]`, not `(?s).`: Oniguruma (the Python
            // `tokenizers` wheel) rejects inline flag groups.
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
            "post_processor": null,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        let inner =
            tokenizers::Tokenizer::from_str(&json.to_string()).expect("the built-in tokenizer definition is valid");
        let mut t = Tokenizer::new(inner);
        let config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": CHAR_SPECIALS[0], "bos_token": CHAR_SPECIALS[1],
            "eos_token": CHAR_SPECIALS[2], "unk_token": CHAR_SPECIALS[3],
            "add_bos_token": false, "add_eos_token": false,
            "clean_up_tokenization_spaces": false,
        });
        if let serde_json::Value::Object(m) = config {
            t.config = m;
        }
        t
    }

    /// Loads a `tokenizer.json`, with the `tokenizer_config.json` beside it when there is one.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("loading `{}`: {e}", path.display())))?;
        let mut t = Tokenizer::new(inner);
        let cfg_path = path.with_file_name(CONFIG_FILE);
        if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path).map_err(Error::io("reading", &cfg_path))?;
            t.config = serde_json::from_str(&text).map_err(|e| Error::Json {
                path: cfg_path.display().to_string(),
                reason: format!("expected a JSON object: {e}"),
            })?;
        }
        Ok(t)
    }

    /// Writes `tokenizer.json` to `path`, and `tokenizer_config.json` beside it when the
    /// tokenizer has one.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| Error::Tokenizer(format!("saving `{}`: {e}", path.display())))?;
        if !self.config.is_empty() {
            let cfg_path = path.with_file_name(CONFIG_FILE);
            let text = serde_json::to_string_pretty(&self.config).unwrap_or_default();
            std::fs::write(&cfg_path, text).map_err(Error::io("writing", &cfg_path))?;
        }
        Ok(())
    }

    /// `tokenizer_config.json` as loaded (empty when there was none).
    pub fn config(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.config
    }

    /// Replaces the `tokenizer_config.json` written beside `tokenizer.json`.
    pub fn set_config(&mut self, config: serde_json::Map<String, serde_json::Value>) {
        self.config = config;
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("encoding {text:?}: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens kept, so stop markers stay visible).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(format!("decoding {} ids: {e}", ids.len())))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_tokenizer_round_trips_and_saves_as_tokenizer_json() {
        let t = Tokenizer::char_level();
        assert_eq!(t.vocab_size(), 4 + 1 + 95);
        let ids = t.encode("12+30=42\n").unwrap();
        assert_eq!(ids.len(), 9);
        assert_eq!(t.decode(&ids).unwrap(), "12+30=42\n");
        assert_eq!(t.eos, Some(2));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer.json");
        t.save(&p).unwrap();
        let back = Tokenizer::from_file(&p).unwrap();
        assert_eq!(back.encode("a b").unwrap(), t.encode("a b").unwrap());
        // A character outside the alphabet is <unk>, not an error.
        assert_eq!(t.encode("é").unwrap(), vec![3]);
        // tokenizer_config.json travels with it.
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(cfg["eos_token"], "<eos>");
        assert_eq!(back.config(), t.config());
        // Only patterns both regex engines read (no inline flag groups such as `(?s)`).
        let json = std::fs::read_to_string(&p).unwrap();
        assert!(!json.contains("(?"), "inline regex flags in {json}");
    }
}
