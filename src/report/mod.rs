//! `streamrl report --run DIR`: plots of a run computed from its archive with SQL, written
//! as standalone SVG and PNG files plus an HTML page that shows them with the queries
//! behind them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use arrow::array::{Array, AsArray};
use arrow::datatypes::{DataType, Float64Type};
use clap::Args;
use streamrl_archive::Sql;
use streamrl_stages::step_metrics::name;

pub mod plot;

use self::plot::{Scene, Shape};

/// `streamrl report` arguments.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Run directory holding `archive/`.
    #[arg(long = "run")]
    run_dir: PathBuf,
    /// Output directory (default: RUN/report).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One chart: a title, the SQL it comes from, and (label, x, y) series.
struct Chart {
    file: &'static str,
    title: &'static str,
    sql: String,
    bars: bool,
}

/// `SELECT name AS series, step AS x, value AS y` of the trainer's metrics `names`.
fn trainer_series(names: &[&str]) -> String {
    let list: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    format!(
        "SELECT name AS series, step AS x, value AS y FROM metrics \
         WHERE stage = 'trainer' AND name IN ({}) ORDER BY name, step",
        list.join(", ")
    )
}

/// The charts, their SQL built from the trainer's metric names ([`name`]).
fn charts() -> Vec<Chart> {
    vec![
        Chart {
            file: "heldout.svg",
            title: "Held-out greedy accuracy per policy version (trainer eval_every)",
            sql: format!(
                "SELECT name AS series, step AS x, value AS y FROM metrics \
                 WHERE stage = 'trainer' AND (name = '{}' OR name LIKE '{}%') ORDER BY name, step",
                name::HELDOUT_ACCURACY,
                name::HELDOUT_PREFIX
            ),
            bars: false,
        },
        Chart {
            file: "reward.svg",
            title: "Mean reward per step (trainer batch)",
            sql: trainer_series(&[name::REWARD_MEAN]),
            bars: false,
        },
        Chart {
            file: "loss.svg",
            title: "Loss, entropy and mismatch KL per step",
            sql: trainer_series(&[name::LOSS, name::ENTROPY, name::MISMATCH_KL]),
            bars: false,
        },
        Chart {
            file: "masking.svg",
            title: "Fraction of trainable tokens masked (ratio below low / above high)",
            sql: trainer_series(&[name::MASKED_LOW, name::MASKED_HIGH]),
            bars: false,
        },
        Chart {
            file: "staleness.svg",
            title: "Staleness histogram: samples by versions behind the trainer",
            sql: format!(
                "SELECT 'samples' AS series, CAST(replace(name, '{p}', '') AS DOUBLE) AS x, sum(value) AS y FROM metrics \
                 WHERE stage = 'trainer' AND name LIKE '{p}%' GROUP BY name ORDER BY x",
                p = name::STALENESS_PREFIX
            ),
            bars: true,
        },
        Chart {
            file: "throughput.svg",
            title: "Trainer tokens/s per step",
            sql: trainer_series(&[name::TOKENS_PER_S]),
            bars: false,
        },
        Chart {
            file: "lag.svg",
            title: "Generation lag: policy versions behind the step a group was admitted for (mean per step)",
            sql: "SELECT 'versions behind' AS series, step AS x, avg(CAST(step AS DOUBLE) - CAST(completion_versions[1] AS DOUBLE)) AS y \
                  FROM rollouts GROUP BY step ORDER BY step"
                .into(),
            bars: false,
        },
    ]
}

/// Named series of (x, y) points.
pub(crate) type Series = Vec<(String, Vec<(f64, f64)>)>;

fn f64_column(a: &dyn Array) -> Result<Vec<f64>> {
    let c = arrow::compute::cast(a, &DataType::Float64)?;
    let c = c.as_primitive::<Float64Type>();
    Ok((0..c.len())
        .map(|i| if c.is_null(i) { f64::NAN } else { c.value(i) })
        .collect())
}

async fn series(sql: &Sql, query: &str) -> Result<Series> {
    let mut out: Series = Vec::new();
    for b in sql.query(query).await? {
        let names = arrow::compute::cast(b.column(0), &DataType::Utf8)?;
        let names = names.as_string::<i32>();
        let (xs, ys) = (f64_column(b.column(1))?, f64_column(b.column(2))?);
        for i in 0..b.num_rows() {
            let name = names.value(i).to_string();
            match out.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => v.push((xs[i], ys[i])),
                None => out.push((name, vec![(xs[i], ys[i])])),
            }
        }
    }
    Ok(out)
}

const COLORS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// A line (or bar) chart with axes, ticks and a legend, as shapes for SVG and PNG.
pub(crate) fn chart(title: &str, data: &Series, bars: bool) -> Scene {
    let pts: Vec<(f64, f64)> = data
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .filter(|p| p.1.is_finite())
        .collect();
    let (w, h) = (720.0, 360.0);
    let mut s = Scene::new(w, h);
    s.push(Shape::Text {
        x: w / 2.0,
        y: 22.0,
        size: 14.0,
        anchor: "middle",
        text: title.to_string(),
    });
    if pts.is_empty() {
        s.push(Shape::Text {
            x: w / 2.0,
            y: h / 2.0,
            size: 12.0,
            anchor: "middle",
            text: "no data".into(),
        });
        return s;
    }
    let frame = Frame::new(w, h, &pts, bars);
    frame.axes(&mut s);
    for (k, (name, v)) in data.iter().enumerate() {
        frame.series(&mut s, k, name, v, bars);
    }
    s
}

/// The plot area of a chart and the data ranges it shows.
struct Frame {
    /// Width and height of the picture.
    w: f64,
    h: f64,
    /// Margins: left, right, top, bottom.
    l: f64,
    r: f64,
    t: f64,
    b: f64,
    /// Data ranges on x and y.
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

impl Frame {
    /// A frame fitting `pts` (bars: with room for the first and last bar, from y = 0).
    fn new(w: f64, h: f64, pts: &[(f64, f64)], bars: bool) -> Self {
        let (mut x0, mut x1) = pts
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (mut y0, mut y1) = pts
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
        if bars {
            y0 = y0.min(0.0);
            x0 -= 0.5;
            x1 += 0.5;
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
        let (l, r, t, b) = (70.0, 20.0, 40.0, 50.0);
        Frame {
            w,
            h,
            l,
            r,
            t,
            b,
            x0,
            x1,
            y0,
            y1,
        }
    }

    fn sx(&self, x: f64) -> f64 {
        self.l + (x - self.x0) / (self.x1 - self.x0) * (self.w - self.l - self.r)
    }

    fn sy(&self, y: f64) -> f64 {
        self.h - self.b - (y - self.y0) / (self.y1 - self.y0) * (self.h - self.t - self.b)
    }

    /// Grid lines, tick labels and the two axes.
    fn axes(&self, s: &mut Scene) {
        let (w, h, l, r, t, b) = (self.w, self.h, self.l, self.r, self.t, self.b);
        let at = |lo: f64, hi: f64| -> Vec<f64> { (0..=4).map(|i| lo + (hi - lo) * i as f64 / 4.0).collect() };
        let (xs, ys) = (at(self.x0, self.x1), at(self.y0, self.y1));
        let (xl, yl) = (ticks(&xs), ticks(&ys));
        for i in 0..=4 {
            let (fx, fy) = (xs[i], ys[i]);
            s.push(Shape::Line {
                x1: l,
                y1: self.sy(fy),
                x2: w - r,
                y2: self.sy(fy),
                color: "#ddd",
                width: 1.0,
            });
            s.push(Shape::Text {
                x: self.sx(fx),
                y: h - b + 18.0,
                size: 12.0,
                anchor: "middle",
                text: xl[i].clone(),
            });
            s.push(Shape::Text {
                x: l - 6.0,
                y: self.sy(fy) + 4.0,
                size: 12.0,
                anchor: "end",
                text: yl[i].clone(),
            });
        }
        for (x1, y1, x2, y2) in [(l, h - b, w - r, h - b), (l, t, l, h - b)] {
            s.push(Shape::Line {
                x1,
                y1,
                x2,
                y2,
                color: "#000",
                width: 1.0,
            });
        }
    }

    /// The `k`-th series (bars or a polyline) and its legend entry.
    fn series(&self, s: &mut Scene, k: usize, name: &str, v: &[(f64, f64)], bars: bool) {
        let color = COLORS[k % COLORS.len()];
        if bars {
            let bw = ((self.w - self.l - self.r) / (self.x1 - self.x0) * 0.8).max(1.0);
            for &(x, y) in v.iter().filter(|p| p.1.is_finite()) {
                s.push(Shape::Rect {
                    x: self.sx(x) - bw / 2.0,
                    y: self.sy(y),
                    w: bw,
                    h: (self.sy(self.y0) - self.sy(y)).max(0.0),
                    color: color.into(),
                });
            }
        } else {
            let points = v
                .iter()
                .filter(|p| p.1.is_finite())
                .map(|&(x, y)| (self.sx(x), self.sy(y)))
                .collect();
            s.push(Shape::Polyline {
                points,
                color,
                width: 1.5,
            });
        }
        s.push(Shape::Rect {
            x: self.l + 10.0 + 150.0 * k as f64,
            y: self.t - 8.0,
            w: 10.0,
            h: 10.0,
            color: color.into(),
        });
        s.push(Shape::Text {
            x: self.l + 24.0 + 150.0 * k as f64,
            y: self.t + 1.0,
            size: 12.0,
            anchor: "start",
            text: name.to_string(),
        });
    }
}

/// Every MoE layer's load per expert per step (`moe/<layer>/load/<expert>` rows), as
/// series named `<layer>/<expert>`.
fn moe_load_sql() -> String {
    format!(
        "SELECT replace(replace(name, '{p}', ''), '/load/', '/') AS series, step AS x, value AS y FROM metrics \
         WHERE stage = 'trainer' AND name LIKE '{p}%/load/%' ORDER BY step",
        p = name::MOE_PREFIX
    )
}

/// A heat map per MoE layer, stacked: steps across, experts down, each cell coloured by
/// the expert's load over the mean load (white at the mean, blue below, red at 2× and
/// above).
fn moe_heatmap(title: &str, loads: &Series) -> Scene {
    let key = |s: &str| -> Option<(usize, usize)> {
        let (l, e) = s.split_once('/')?;
        Some((l.parse().ok()?, e.parse().ok()?))
    };
    // (layer, expert, its (step, share) points).
    type Cell<'a> = (usize, usize, &'a [(f64, f64)]);
    let cells: Vec<Cell> = loads
        .iter()
        .filter_map(|(n, v)| key(n).map(|(l, e)| (l, e, v.as_slice())))
        .collect();
    let layers = cells.iter().map(|c| c.0).max().map_or(0, |m| m + 1);
    let experts = cells.iter().map(|c| c.1).max().map_or(0, |m| m + 1);
    let steps: Vec<f64> = {
        let mut s: Vec<f64> = cells.iter().flat_map(|c| c.2.iter().map(|p| p.0)).collect();
        s.sort_by(f64::total_cmp);
        s.dedup();
        s
    };
    let (w, l, r, t, row, gap) = (720.0, 90.0, 20.0, 40.0, 12.0, 28.0);
    let panel = row * experts as f64;
    let h = t + layers as f64 * (panel + gap) + 30.0;
    let mut s = Scene::new(w, h);
    s.push(Shape::Text {
        x: w / 2.0,
        y: 22.0,
        size: 13.0,
        anchor: "middle",
        text: title.to_string(),
    });
    let (x0, x1) = (
        steps.first().copied().unwrap_or(0.0),
        steps.last().copied().unwrap_or(1.0),
    );
    let span = (x1 - x0).max(1.0);
    let cw = ((w - l - r) / steps.len().max(1) as f64).max(0.5);
    let sx = |x: f64| l + (x - x0) / span * (w - l - r - cw);
    for layer in 0..layers {
        let top = t + layer as f64 * (panel + gap);
        s.push(Shape::Text {
            x: l - 8.0,
            y: top + panel / 2.0 + 4.0,
            size: 12.0,
            anchor: "end",
            text: format!("layer {layer}"),
        });
        for &(_, e, v) in cells.iter().filter(|c| c.0 == layer) {
            for &(x, y) in v {
                s.push(Shape::Rect {
                    x: sx(x),
                    y: top + e as f64 * row,
                    w: cw + 0.3,
                    h: row,
                    color: load_color(y * experts as f64).into(),
                });
            }
        }
        for (x, text) in [(l, format!("step {x0:.0}")), (w - r, format!("step {x1:.0}"))] {
            s.push(Shape::Text {
                x,
                y: top + panel + 14.0,
                size: 11.0,
                anchor: if x == l { "start" } else { "end" },
                text,
            });
        }
    }
    s.push(Shape::Text {
        x: w / 2.0,
        y: h - 8.0,
        size: 11.0,
        anchor: "middle",
        text: format!(
            "rows: experts 0–{} per layer; white: the mean load, blue: none, red: 2× the mean or more",
            experts.saturating_sub(1)
        ),
    });
    s
}

/// The colour of a load `ratio` (1: the mean): white at 1, blending to blue at 0 and to
/// red at 2 and above.
fn load_color(ratio: f64) -> String {
    let t = (ratio - 1.0).clamp(-1.0, 1.0);
    let (to, f) = if t < 0.0 {
        ([33.0, 102.0, 172.0], -t)
    } else {
        ([178.0, 24.0, 43.0], t)
    };
    let c = |i: usize| (255.0 + (to[i] - 255.0) * f).round() as u8;
    format!("#{:02x}{:02x}{:02x}", c(0), c(1), c(2))
}

/// The labels of one axis's ticks, all with as many decimals (at most 3) as the one that
/// needs the most: `0, 4, 8, 12, 16`, or `0.39, 0.41, 0.43`, never `0.000` beside `12`.
fn ticks(values: &[f64]) -> Vec<String> {
    let exact = |v: f64, d: i32| {
        let p = 10f64.powi(d);
        ((v * p).round() / p - v).abs() <= 1e-9 * v.abs().max(1.0)
    };
    let d = (0..=3).find(|&d| values.iter().all(|&v| exact(v, d))).unwrap_or(3) as usize;
    values.iter().map(|v| format!("{v:.d$}")).collect()
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// `streamrl report`: writes the page and says where.
pub async fn run(a: ReportArgs) -> Result<()> {
    let page = report(a).await?;
    println!("wrote {}", page.display());
    Ok(())
}

/// Writes the report; returns the HTML page's path.
pub async fn report(a: ReportArgs) -> Result<PathBuf> {
    let out = a.out.unwrap_or_else(|| a.run_dir.join("report"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let sql = Sql::open(&a.run_dir).await?;
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>streamrl run report</title>\
         <style>body{font-family:sans-serif;max-width:760px;margin:2em auto}pre{background:#f4f4f4;padding:.5em;white-space:pre-wrap}</style>\
         </head><body><h1>streamrl run report</h1>",
    );
    let _ = write!(
        html,
        "<p>Run directory: <code>{}</code></p>",
        xml(&a.run_dir.display().to_string())
    );
    for c in &charts() {
        let data = if c.sql.contains("FROM rollouts") && !sql.tables().iter().any(|t| t == "rollouts")
            || c.sql.contains("FROM metrics") && !sql.tables().iter().any(|t| t == "metrics")
        {
            Vec::new()
        } else {
            series(&sql, &c.sql)
                .await
                .with_context(|| format!("query for {}", c.file))?
        };
        let scene = chart(c.title, &data, c.bars);
        write_file(&out.join(c.file), &scene.to_svg())?;
        let png = c.file.replace(".svg", ".png");
        std::fs::write(out.join(&png), scene.to_png()).with_context(|| format!("writing {png}"))?;
        let _ = write!(
            html,
            "<h2>{}</h2><img src=\"{}\" alt=\"{}\"><p><a href=\"{png}\">PNG</a></p><pre>{}</pre>",
            xml(c.title),
            c.file,
            xml(c.title),
            xml(&c.sql)
        );
    }
    if sql.tables().iter().any(|t| t == "metrics") {
        let q = moe_load_sql();
        let loads = series(&sql, &q).await.context("query for moe-load.svg")?;
        if !loads.is_empty() {
            let title = "MoE expert load per step: each expert's share of its layer's tokens over the mean share";
            let scene = moe_heatmap(title, &loads);
            write_file(&out.join("moe-load.svg"), &scene.to_svg())?;
            std::fs::write(out.join("moe-load.png"), scene.to_png()).context("writing moe-load.png")?;
            let _ = write!(
                html,
                "<h2>{}</h2><img src=\"moe-load.svg\" alt=\"{}\"><p><a href=\"moe-load.png\">PNG</a></p><pre>{}</pre>",
                xml(title),
                xml(title),
                xml(&q)
            );
        }
    }
    html.push_str("<h2>Rows per topic</h2><table border=\"1\" cellpadding=\"4\"><tr><th>topic</th><th>rows</th></tr>");
    for t in sql.tables() {
        let n = sql.query(&format!("SELECT count(*) FROM \"{t}\"")).await?;
        let rows = n
            .first()
            .map(|b| f64_column(b.column(0)).unwrap_or_default())
            .unwrap_or_default();
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td></tr>",
            xml(t),
            rows.first().copied().unwrap_or(0.0)
        );
    }
    html.push_str("</table></body></html>");
    let page = out.join("index.html");
    write_file(&page, &html)?;
    Ok(page)
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_axis_labels_its_ticks_with_one_precision() {
        let t = |v: &[f64]| super::ticks(v);
        assert_eq!(t(&[0.0, 4.0, 8.0, 12.0, 16.0]), ["0", "4", "8", "12", "16"]);
        assert_eq!(
            t(&[0.39, 0.41, 0.43, 0.45, 0.47]),
            ["0.39", "0.41", "0.43", "0.45", "0.47"]
        );
        assert_eq!(t(&[0.0, 2.5, 5.0, 7.5, 10.0]), ["0.0", "2.5", "5.0", "7.5", "10.0"]);
        assert_eq!(t(&[0.0, 1.0 / 3.0, 2.0 / 3.0]), ["0.000", "0.333", "0.667"]);
        assert_eq!(t(&[0.0, 2500.5, 5001.0]), ["0.0", "2500.5", "5001.0"]);
    }

    #[test]
    fn the_load_heat_map_is_white_at_the_mean_and_draws_a_cell_per_layer_expert_and_step() {
        assert_eq!(super::load_color(1.0), "#ffffff");
        assert_eq!(super::load_color(0.0), "#2166ac");
        assert_eq!(super::load_color(2.0), "#b2182b");
        assert_eq!(super::load_color(7.0), "#b2182b");
        // Two layers of 4 experts over 3 steps: 24 cells, in the SVG.
        let loads: super::Series = (0..2)
            .flat_map(|l| (0..4).map(move |e| (format!("{l}/{e}"), (0..3).map(|s| (s as f64, 0.25)).collect())))
            .collect();
        let svg = super::moe_heatmap("load", &loads).to_svg();
        assert_eq!(svg.matches("fill=\"#ffffff\"").count(), 24, "{svg}");
        assert!(svg.contains("layer 1") && !svg.contains("layer 2"));
    }
}
