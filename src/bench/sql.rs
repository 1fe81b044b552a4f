//! `streamrl bench sql`: `streamrl query` against DuckDB on the same archive.
//!
//! Each query runs as a whole `streamrl query` process (start-up, table registration,
//! planning, scan, printing CSV to /dev/null), and in DuckDB (the Python module: a fresh
//! connection per run with one view per topic over `read_parquet`, timed inside one
//! Python process, so DuckDB pays no process start). Each cell is the median of
//! `--rounds` runs; the ratio is streamrl / DuckDB and the last row is the geometric mean.
//! Both must return the same number of rows.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// The queries people type (the README's among them), by name.
const QUERIES: &[(&str, &str)] = &[
    ("count rollouts", "SELECT count(*) FROM rollouts"),
    (
        "tokens per step",
        "SELECT step, count(*) AS n, avg(array_length(completion_token_ids)) AS len FROM rollouts GROUP BY step ORDER BY step",
    ),
    (
        "reward by version",
        "SELECT completion_versions[1] AS version, avg(reward) AS reward, count(*) AS n FROM scored GROUP BY 1 ORDER BY 1",
    ),
    (
        "lineage counts",
        "SELECT version, outcome, count(*) FROM trained GROUP BY 1, 2 ORDER BY 1, 2",
    ),
    (
        "lineage of a version",
        "SELECT t.outcome, s.group_id, s.sample_id, s.reward, s.advantage FROM trained t JOIN samples s \
         ON s.sample_id = t.sample_id AND s.created_at = t.sample_created_at WHERE t.version = 12",
    ),
    (
        "staleness metrics",
        "SELECT name, sum(value) AS samples FROM metrics WHERE stage = 'trainer' AND name LIKE 'staleness_%' \
         GROUP BY name ORDER BY name",
    ),
    (
        "good completions",
        "SELECT sample_id, completion FROM scored WHERE reward > 0 AND step BETWEEN 100 AND 110",
    ),
    (
        "one sample",
        "SELECT r.completion, s.reward FROM rollouts r JOIN scored s ON s.sample_id = r.sample_id \
         WHERE r.sample_id = (SELECT max(sample_id) FROM rollouts WHERE step = 450)",
    ),
];

const DUCKDB: &str = r#"
import json, os, sys, time, duckdb
root, rounds = sys.argv[1], int(sys.argv[2])
queries = json.loads(sys.stdin.read())
topics = sorted(t for t in os.listdir(root)
                if any(f.endswith(".parquet") for f in os.listdir(os.path.join(root, t))))
out = []
for q in queries:
    times, rows = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        con = duckdb.connect()
        for t in topics:
            con.execute(f"CREATE VIEW \"{t}\" AS SELECT * FROM read_parquet('{root}/{t}/*.parquet')")
        rows = len(con.execute(q).fetchall())
        con.close()
        times.append(time.perf_counter() - t0)
    out.append({"secs": sorted(times)[len(times) // 2], "rows": rows})
print(json.dumps(out))
"#;

/// The test tools' Python directory: `$STREAMRL_TOOLS_DIR/py`, else `target/test-tools/py`.
pub(crate) fn tools_python_dir() -> PathBuf {
    std::env::var_os("STREAMRL_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/test-tools"))
        .join("py")
}

/// A python3 that imports `module` (e.g. `duckdb` or `torch, transformers`): plain
/// `python3`, or with PYTHONPATH set to the test tools' Python directory
/// (`$STREAMRL_TOOLS_DIR/py`, else `target/test-tools/py`, where the interop tests install
/// them). `None`: neither.
pub(crate) fn python_importing(module: &str) -> Option<Option<PathBuf>> {
    [None, Some(tools_python_dir())].into_iter().find(|path| {
        let mut c = Command::new("python3");
        c.args(["-c", &format!("import {module}")]);
        if let Some(p) = path {
            c.env("PYTHONPATH", p);
        }
        c.output().map(|o| o.status.success()).unwrap_or(false)
    })
}

/// One `streamrl query` process: its wall time and the rows it printed.
fn streamrl_query(exe: &Path, run_dir: &Path, sql: &str) -> Result<(f64, usize)> {
    let t0 = Instant::now();
    let out = Command::new(exe)
        .args(["query", "--format", "csv", "--run-dir"])
        .arg(run_dir)
        .arg(sql)
        .stderr(Stdio::inherit())
        .output()
        .context("running streamrl query")?;
    let secs = t0.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("streamrl query failed on: {sql}");
    }
    // CSV: a header, then one line per row (no value here holds a newline... except
    // completions, which csv quotes; count records properly).
    let rows = csv_records(&out.stdout).saturating_sub(1);
    Ok((secs, rows))
}

/// Records in CSV text (newlines inside quotes do not end a record).
fn csv_records(b: &[u8]) -> usize {
    let (mut n, mut quoted, mut open) = (0, false, false);
    for &c in b {
        match c {
            b'"' => quoted = !quoted,
            b'\n' if !quoted => {
                n += 1;
                open = false;
                continue;
            }
            _ => {}
        }
        open = true;
    }
    n + usize::from(open)
}

pub fn run(run_dir: &Path, rounds: usize, exe: Option<PathBuf>) -> Result<()> {
    let exe = match exe {
        Some(e) => e,
        None => std::env::current_exe()?,
    };
    let archive = run_dir.join("archive");
    if !archive.is_dir() {
        bail!(
            "no archive under {} (run `streamrl run` first, or pass --run-dir)",
            run_dir.display()
        );
    }
    let files = walk_parquet(&archive);
    println!(
        "streamrl bench sql (profile: {}) on {} ({} Parquet files, {:.1} MB), median of {rounds}, timing {}",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        archive.display(),
        files.0,
        files.1 as f64 / 1e6,
        exe.display()
    );
    let duck = duckdb_times(&archive, rounds)?;
    println!();
    println!(
        "{:<22} {:>8} {:>16} {:>12} {:>7}",
        "query", "rows", "streamrl (ms)", "DuckDB (ms)", "ratio"
    );
    let mut log_sum = 0.0;
    for (i, (name, sql)) in QUERIES.iter().enumerate() {
        let mut times = Vec::with_capacity(rounds);
        let mut rows = 0;
        for _ in 0..rounds {
            let (t, r) = streamrl_query(&exe, run_dir, sql)?;
            times.push(t);
            rows = r;
        }
        let ours = super::stats::median(times);
        match &duck {
            Some(d) => {
                let (theirs, their_rows) = d[i];
                if their_rows != rows {
                    bail!("`{name}`: streamrl returned {rows} rows, DuckDB {their_rows}");
                }
                log_sum += (ours / theirs).ln();
                println!(
                    "{name:<22} {rows:>8} {:>16.1} {:>12.1} {:>7.2}",
                    ours * 1e3,
                    theirs * 1e3,
                    ours / theirs
                );
            }
            None => println!("{name:<22} {rows:>8} {:>16.1} {:>12} {:>7}", ours * 1e3, "–", "–"),
        }
    }
    if duck.is_some() {
        println!(
            "{:<22} {:>8} {:>16} {:>12} {:>7.2}",
            "geometric mean",
            "",
            "",
            "",
            (log_sum / QUERIES.len() as f64).exp()
        );
        println!("  streamrl: a whole `streamrl query --format csv` process each (start-up included);");
        println!("  DuckDB: a fresh connection + one view per topic + the query, inside one python3.");
    }
    Ok(())
}

/// Every query's median seconds and row count in DuckDB over the archive's Parquet files
/// (`None`: no python3 here imports duckdb).
fn duckdb_times(archive: &Path, rounds: usize) -> Result<Option<Vec<(f64, usize)>>> {
    let Some(path) = python_importing("duckdb") else {
        println!("DuckDB: not measured (no python3 that imports duckdb; `pip install duckdb`)");
        return Ok(None);
    };
    let mut c = Command::new("python3");
    c.args(["-c", DUCKDB])
        .arg(archive)
        .arg(rounds.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(p) = path {
        c.env("PYTHONPATH", p);
    }
    let mut child = c.spawn()?;
    let queries: Vec<&str> = QUERIES.iter().map(|q| q.1).collect();
    std::io::Write::write_all(
        &mut child.stdin.take().context("duckdb stdin")?,
        serde_json::to_string(&queries)?.as_bytes(),
    )?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("the DuckDB run failed");
    }
    let v: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    Ok(Some(
        v.iter()
            .map(|x| {
                (
                    x["secs"].as_f64().unwrap_or(f64::NAN),
                    x["rows"].as_u64().unwrap_or(0) as usize,
                )
            })
            .collect(),
    ))
}

/// Parquet files under `dir` and their total bytes.
fn walk_parquet(dir: &Path) -> (usize, u64) {
    let mut acc = (0, 0);
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            let (n, b) = walk_parquet(&p);
            acc = (acc.0 + n, acc.1 + b);
        } else if p.extension().is_some_and(|x| x == "parquet") {
            acc = (acc.0 + 1, acc.1 + e.metadata().map(|m| m.len()).unwrap_or(0));
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    #[test]
    fn csv_records_count_quoted_newlines_once() {
        assert_eq!(super::csv_records(b"a,b\n1,\"x\ny\"\n2,z\n"), 3);
        assert_eq!(super::csv_records(b"a\n1"), 2);
        assert_eq!(super::csv_records(b""), 0);
    }
}
