//! Dataset files: JSON Lines (`.jsonl`, one object per line) or Parquet (`.parquet`, e.g.
//! a Hugging Face dataset exported with `datasets.Dataset.to_parquet`). Either way each
//! record comes back as a JSON object, so environments read both with one serde struct.

use std::path::Path;

use crate::Invalid;

/// A finite dataset's problems, split into train and eval: every `eval_every`-th problem
/// (by position) is held out.
#[derive(Debug, Clone)]
pub struct Splits {
    train: Vec<crate::Problem>,
    eval: Vec<crate::Problem>,
}

impl Splits {
    /// Splits `all` (`eval_every` ≥ 2, checked by the caller).
    pub fn new(all: Vec<crate::Problem>, eval_every: usize) -> Self {
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        for (i, p) in all.into_iter().enumerate() {
            if i % eval_every == eval_every - 1 {
                eval.push(p)
            } else {
                train.push(p)
            }
        }
        Splits { train, eval }
    }

    fn pool(&self, split: crate::Split) -> &[crate::Problem] {
        if split == crate::Split::Eval {
            &self.eval
        } else {
            &self.train
        }
    }

    /// The problem `seed` picks from `split` (wrapping around).
    pub fn sample(&self, split: crate::Split, seed: u64) -> crate::Problem {
        let pool = self.pool(split);
        pool[(seed % pool.len() as u64) as usize].clone()
    }

    /// Problems in `split`.
    pub fn len(&self, split: crate::Split) -> usize {
        self.pool(split).len()
    }

    /// Every problem of `split`.
    pub fn problems(&self, split: crate::Split) -> &[crate::Problem] {
        self.pool(split)
    }

    /// The splits of a dataset's problems, once its config and rows were checked: `errs`
    /// (the problems found so far) with those of `eval_every` and, when there is no other,
    /// of a dataset with fewer than two problems; or the splits when there is none.
    pub fn checked(all: Vec<crate::Problem>, eval_every: usize, mut errs: Vec<Invalid>) -> Result<Self, Vec<Invalid>> {
        errs.extend(check_eval_every(eval_every as u64));
        if errs.is_empty() && all.len() < 2 {
            errs.push(Invalid::new(
                "dataset",
                format!("has {} problems; need at least 2", all.len()),
            ));
        }
        if errs.is_empty() {
            Ok(Splits::new(all, eval_every))
        } else {
            Err(errs)
        }
    }
}

/// The problem with an `eval_every` (one problem in this many held out) below 2, if any.
pub fn check_eval_every(eval_every: u64) -> Option<Invalid> {
    (eval_every < 2).then(|| Invalid::new("eval_every", format!("{eval_every} must be at least 2")))
}

/// [`load_as`] with its problems under the config key `dataset`: the rows (none when any
/// line is bad) and the problems.
pub fn rows<T: serde::de::DeserializeOwned>(path: Option<&str>, fixture: &str) -> (Vec<(usize, T)>, Vec<Invalid>) {
    match load_as::<T>(path, fixture) {
        Ok(rows) => (rows, Vec::new()),
        Err(e) => (Vec::new(), e.into_iter().map(|e| Invalid::new("dataset", e)).collect()),
    }
}

/// One record: its 1-based line (JSONL) or row (Parquet) number and its fields.
pub type Record = (usize, serde_json::Value);

/// Loads every record of a dataset file; every bad line is reported.
pub fn load(path: &str) -> Result<Vec<Record>, Vec<String>> {
    let p = Path::new(path);
    if p.extension().is_some_and(|e| e == "parquet") {
        return load_parquet(p).map_err(|e| vec![format!("dataset `{path}`: {e}")]);
    }
    let text = std::fs::read_to_string(p).map_err(|e| vec![format!("dataset `{path}`: {e}")])?;
    parse_jsonl(&text)
}

/// Parses JSON Lines (blank lines skipped); every bad line is reported.
pub fn parse_jsonl(text: &str) -> Result<Vec<Record>, Vec<String>> {
    let (out, errs) = split_jsonl(text);
    if errs.is_empty() { Ok(out) } else { Err(errs) }
}

/// The dataset at `path` (or the built-in `fixture` text when `None`) as `T`s, with every
/// line that is not JSON or does not fit `T` reported.
pub fn load_as<T: serde::de::DeserializeOwned>(
    path: Option<&str>,
    fixture: &str,
) -> Result<Vec<(usize, T)>, Vec<String>> {
    let (records, mut errs) = match path {
        None => split_jsonl(fixture),
        Some(p) if Path::new(p).extension().is_some_and(|e| e == "parquet") => (load(p)?, vec![]),
        Some(p) => split_jsonl(&std::fs::read_to_string(p).map_err(|e| vec![format!("dataset `{p}`: {e}")])?),
    };
    match typed(records) {
        Ok(t) if errs.is_empty() => Ok(t),
        Ok(_) => Err(errs),
        Err(e) => {
            errs.extend(e);
            errs.sort_by_key(|e| {
                e.split_whitespace()
                    .nth(2)
                    .and_then(|n| n.trim_end_matches(':').parse::<usize>().ok())
            });
            Err(errs)
        }
    }
}

fn split_jsonl(text: &str) -> (Vec<Record>, Vec<String>) {
    let mut errs = vec![];
    let mut out = vec![];
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) if v.is_object() => out.push((n + 1, v)),
            Ok(_) => errs.push(format!("dataset line {}: not a JSON object", n + 1)),
            Err(e) => errs.push(format!("dataset line {}: {e}", n + 1)),
        }
    }
    (out, errs)
}

fn load_parquet(p: &Path) -> Result<Vec<Record>, String> {
    let file = std::fs::File::open(p).map_err(|e| e.to_string())?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.build())
        .map_err(|e| format!("not a readable Parquet file: {e}"))?;
    let mut out = vec![];
    for batch in reader {
        let batch = batch.map_err(|e| e.to_string())?;
        let mut w = arrow::json::ArrayWriter::new(Vec::new());
        w.write(&batch).map_err(|e| e.to_string())?;
        w.finish().map_err(|e| e.to_string())?;
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&w.into_inner()).map_err(|e| e.to_string())?;
        for r in rows {
            out.push((out.len() + 1, r));
        }
    }
    Ok(out)
}

/// Deserialises records into `T`, naming the line or row of every one that does not fit.
pub fn typed<T: serde::de::DeserializeOwned>(records: Vec<Record>) -> Result<Vec<(usize, T)>, Vec<String>> {
    let mut errs = vec![];
    let mut out = vec![];
    for (n, v) in records {
        match serde_json::from_value(v) {
            Ok(t) => out.push((n, t)),
            Err(e) => errs.push(format!("dataset line {n}: {e}")),
        }
    }
    if errs.is_empty() { Ok(out) } else { Err(errs) }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ListBuilder, RecordBatch, StringArray, StringBuilder};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    #[test]
    fn jsonl_and_parquet_give_the_same_records() {
        let dir = std::env::temp_dir().join(format!("streamrl-dataset-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut tests = ListBuilder::new(StringBuilder::new());
        tests.values().append_value("assert f(1) == 2");
        tests.append(true);
        tests.values().append_value("assert f(2) == 3");
        tests.values().append_value("assert f(0) == 1");
        tests.append(true);
        let schema = Arc::new(Schema::new(vec![
            Field::new("question", DataType::Utf8, false),
            Field::new("answer", DataType::Utf8, false),
            Field::new(
                "tests",
                DataType::List(Arc::new(Field::new("item", DataType::Utf8, true))),
                false,
            ),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from(vec!["1+1?", "2+2?"])),
                Arc::new(StringArray::from(vec!["2", "4"])),
                Arc::new(tests.finish()),
            ],
        )
        .unwrap();
        let path = dir.join("d.parquet");
        let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), schema, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let pq = load(path.to_str().unwrap()).unwrap();
        let jsonl = parse_jsonl(
            "{\"question\":\"1+1?\",\"answer\":\"2\",\"tests\":[\"assert f(1) == 2\"]}\n\n{\"question\":\"2+2?\",\"answer\":\"4\",\"tests\":[\"assert f(2) == 3\",\"assert f(0) == 1\"]}\n",
        )
        .unwrap();
        assert_eq!(
            pq.iter().map(|r| &r.1).collect::<Vec<_>>(),
            jsonl.iter().map(|r| &r.1).collect::<Vec<_>>()
        );
        assert_eq!(jsonl[1].0, 3, "line numbers count blank lines");
        let e = load(dir.join("missing.parquet").to_str().unwrap()).unwrap_err();
        assert!(e[0].contains("missing.parquet"), "{e:?}");
        std::fs::write(dir.join("bad.parquet"), b"not parquet").unwrap();
        let e = load(dir.join("bad.parquet").to_str().unwrap()).unwrap_err();
        assert!(e[0].contains("not a readable Parquet file"), "{e:?}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
