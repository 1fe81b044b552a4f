//! Tokenizers: any Hugging Face `tokenizer.json`, and a built-in character tokenizer for
//! synthetic tasks that is saved as an ordinary `tokenizer.json`, so every code path is the
//! one real models take.

use std::path::Path;
use std::str::FromStr;

use crate::{Error, Result};

/// Special tokens of the character tokenizer, at ids 0..4.
pub const CHAR_SPECIALS: [&str; 4] = ["<pad>", "<bos>", "<eos>", "<unk>"];

/// A tokenizer with its special ids resolved.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// End-of-sequence id, if the vocabulary has one.
    pub eos: Option<u32>,
    /// Beginning-of-sequence id, if any.
    pub bos: Option<u32>,
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
        Tokenizer { inner, eos, bos }
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
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(?s)."}, "behavior": "Isolated", "invert": false},
            "post_processor": null,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        let inner =
            tokenizers::Tokenizer::from_str(&json.to_string()).expect("the built-in tokenizer definition is valid");
        Tokenizer::new(inner)
    }

    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("loading `{}`: {e}", path.display())))?;
        Ok(Tokenizer::new(inner))
    }

    /// Writes `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| Error::Tokenizer(format!("saving `{}`: {e}", path.display())))
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
    }
}
