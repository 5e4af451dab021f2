//! `harness compare`: a table of chosen metrics per run (last, best, at a step), the config keys
//! that differ between the runs, sweep rankings, and metric-curve plots (plotters, SVG or PNG).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::config;
use crate::store::{RunRow, Store};

/// Curves to plot: per metric, per run label, the `(step, value)` series.
pub type Curves = [(String, Vec<(String, Vec<(i64, f64)>)>)];

/// Whether larger values of a metric are better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Losses, KL, gradient norms and timings are minimised; everything else (scores,
    /// accuracies, entropy) maximised.
    Auto,
    /// Larger is better.
    Max,
    /// Smaller is better.
    Min,
}

impl Mode {
    /// Whether `key` is maximised under this mode.
    pub fn maximise(self, key: &str) -> bool {
        match self {
            Mode::Max => true,
            Mode::Min => false,
            Mode::Auto => !["loss", "kl", "timing", "grad_norm"]
                .iter()
                .any(|w| key.contains(w)),
        }
    }
}

/// One metric's summary for one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// The last value (at the largest step).
    pub last: f64,
    /// The best value under the mode, with its step.
    pub best: (i64, f64),
    /// The value at the asked step (the last at or before it).
    pub at: Option<f64>,
}

/// Summarises a series.
pub fn summarise(series: &[(i64, f64)], maximise: bool, at_step: Option<i64>) -> Option<Summary> {
    let last = series.last()?.1;
    let mut best = series[0];
    for &(s, v) in series {
        let better = if maximise { v > best.1 } else { v < best.1 };
        if better || best.1.is_nan() {
            best = (s, v);
        }
    }
    let at = at_step.and_then(|n| series.iter().rev().find(|(s, _)| *s <= n).map(|p| p.1));
    Some(Summary { last, best, at })
}

/// The summary of [`summarise`] from the store's aggregates (a series of NaN only shows NaN
/// as its best, at its last step).
fn from_store(f: &crate::store::MetricSummary, maximise: bool) -> Option<Summary> {
    let (last_step, last) = f.last?;
    let best = if maximise { f.max } else { f.min };
    Some(Summary {
        last,
        best: best.unwrap_or((last_step, f64::NAN)),
        at: f.at,
    })
}

fn fmt(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v != 0.0 && (v.abs() < 1e-3 || v.abs() >= 1e5) {
        format!("{v:.4e}")
    } else {
        format!("{v:.4}")
    }
}

/// The metrics every run has (timings left out), for a compare without `--metric`.
pub async fn common_metrics(store: &Store, runs: &[RunRow]) -> Result<Vec<String>> {
    let mut common: Option<BTreeSet<String>> = None;
    for r in runs {
        let keys: BTreeSet<String> = store.metric_keys(r.id).await?.into_iter().collect();
        common = Some(match common {
            None => keys,
            Some(c) => c.intersection(&keys).cloned().collect(),
        });
    }
    Ok(common
        .unwrap_or_default()
        .into_iter()
        .filter(|k| !rl_core::is_wall_clock(k))
        .collect())
}

/// The compare report: metric table, then config differences.
pub async fn report(
    store: &Store,
    runs: &[RunRow],
    metrics: &[String],
    mode: Mode,
    at_step: Option<i64>,
) -> Result<String> {
    let mut out = String::new();
    let width = runs
        .iter()
        .map(|r| r.name.len() + 8)
        .max()
        .unwrap_or(8)
        .max(12);
    let _ = write!(out, "{:<width$} {:<10}", "run", "status");
    for m in metrics {
        let _ = write!(out, " | {m}: last / best@step");
        if let Some(n) = at_step {
            let _ = write!(out, " / @{n}");
        }
    }
    out.push('\n');
    for r in runs {
        let _ = write!(
            out,
            "{:<width$} {:<10}",
            format!("{} {}", r.id, r.name),
            r.effective_status()
        );
        let found = store.summaries(r.id, metrics, at_step).await?;
        for m in metrics {
            match found.get(m).and_then(|f| from_store(f, mode.maximise(m))) {
                Some(s) => {
                    let _ = write!(out, " | {} / {}@{}", fmt(s.last), fmt(s.best.1), s.best.0);
                    if at_step.is_some() {
                        let _ = write!(out, " / {}", s.at.map(fmt).unwrap_or_else(|| "-".into()));
                    }
                }
                None => out.push_str(" | -"),
            }
        }
        out.push('\n');
    }
    let diffs = config_differences(runs)?;
    if diffs.is_empty() {
        out.push_str("\nconfigs: identical\n");
    } else {
        out.push_str("\nconfig differences:\n");
        for (key, values) in diffs {
            let vals: Vec<String> = runs
                .iter()
                .zip(values)
                .map(|(r, v)| {
                    format!(
                        "{}={}",
                        r.id,
                        v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
                    )
                })
                .collect();
            let _ = writeln!(out, "  {key}: {}", vals.join("  "));
        }
    }
    Ok(out)
}

/// Config keys whose values are not the same in every run, with each run's value.
pub fn config_differences(runs: &[RunRow]) -> Result<BTreeMap<String, Vec<Option<Value>>>> {
    let flats: Vec<BTreeMap<String, Value>> = runs
        .iter()
        .map(|r| {
            serde_json::from_str::<Value>(&r.config)
                .map(|v| config::flatten(&v))
                .with_context(|| format!("the stored config of run {}", r.id))
        })
        .collect::<Result<_>>()?;
    let keys: BTreeSet<&String> = flats.iter().flat_map(|f| f.keys()).collect();
    let mut out = BTreeMap::new();
    for k in keys {
        let vals: Vec<Option<Value>> = flats.iter().map(|f| f.get(k).cloned()).collect();
        if vals.iter().any(|v| v != &vals[0]) {
            out.insert(k.clone(), vals);
        }
    }
    Ok(out)
}

/// One trial of a ranked sweep.
#[derive(Debug, Clone)]
pub struct RankedTrial {
    /// The stored trial (parameters, state, run).
    pub trial: crate::analysis::sweep::TrialRow,
    /// Its run's best value of the metric under the mode; `None` when it has none yet.
    pub best: Option<f64>,
}

/// A sweep's trials ranked by `metric` (best value under the mode; trials without a value
/// last), with its id as resolved; `maximise` says which way.
pub async fn rank_trials(
    store: &Store,
    sweep: &str,
    metric: &str,
    maximise: bool,
) -> Result<(String, Vec<RankedTrial>)> {
    // a sweep's name (`[sweep] name`) stands for its latest sweep
    let sweep = store.resolve_sweep(sweep).await?;
    let trials = crate::analysis::sweep::trials(store, &sweep).await?;
    if trials.is_empty() {
        bail!(
            "no sweep {sweep:?} (or it has no trials) in {}",
            store.path().display()
        );
    }
    let mut ranked = Vec::new();
    for trial in trials {
        let best = match trial.run_id {
            Some(id) => {
                summarise(&store.series(id, metric).await?, maximise, None).map(|s| s.best.1)
            }
            None => None,
        };
        ranked.push(RankedTrial { trial, best });
    }
    ranked.sort_by(|a, b| match (a.best, b.best) {
        (Some(x), Some(y)) => {
            let o = x.partial_cmp(&y).unwrap_or(std::cmp::Ordering::Equal);
            if maximise { o.reverse() } else { o }
        }
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
    Ok((sweep, ranked))
}

/// A sweep's trials ranked by `metric` (best value under the mode), with their parameters.
pub async fn rank_sweep(store: &Store, sweep: &str, metric: &str, mode: Mode) -> Result<String> {
    let maximise = mode.maximise(metric);
    let (sweep, ranked) = rank_trials(store, sweep, metric, maximise).await?;
    let mut out = format!(
        "sweep {sweep}: trials ranked by best {metric} ({})\n{:<4} {:<16} {:<9} {:>6} {:>12}  params\n",
        if maximise { "max" } else { "min" },
        "rank",
        "trial",
        "state",
        "run",
        metric
    );
    for (i, r) in ranked.iter().enumerate() {
        let t = &r.trial;
        let _ = writeln!(
            out,
            "{:<4} {:<16} {:<9} {:>6} {:>12}  {}",
            i + 1,
            t.trial_id,
            t.state,
            t.run_id
                .map(|i| i.to_string())
                .unwrap_or_else(|| "-".into()),
            r.best.map(fmt).unwrap_or_else(|| "-".into()),
            crate::analysis::sweep::params_text(&t.params, " ")
        );
    }
    Ok(out)
}

/// Exponential moving average with TensorBoard's weighting (0 = none, < 1).
pub fn smooth(series: &[(i64, f64)], weight: f64) -> Vec<(i64, f64)> {
    if weight <= 0.0 {
        return series.to_vec();
    }
    let mut acc = None;
    series
        .iter()
        .map(|&(s, v)| {
            let next = match acc {
                None => v,
                Some(a) => weight * a + (1.0 - weight) * v,
            };
            acc = Some(next);
            (s, next)
        })
        .collect()
}

/// Candidate TrueType fonts for plot text (Debian's fonts-dejavu-core and similar).
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

fn register_font() -> Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let env = std::env::var("HARNESS_PLOT_FONT").ok();
        let paths = env.iter().map(String::as_str).chain(FONT_PATHS.iter().copied());
        for p in paths {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(format!(
            "no TrueType font found for plot text (looked in {}); install Debian's fonts-dejavu-core or set HARNESS_PLOT_FONT",
            FONT_PATHS.join(", ")
        ))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// A panel's step and value ranges for its (finite) points: the steps with a quarter more on
/// the right, where the legend goes, clear of the curves' last steps; the values, a band
/// narrower than 5% of their size (at least 1e-6) widened to that, so that rounding noise does
/// not fill the panel as if it were a trend.
fn axes(points: &[(i64, f64)]) -> ((i64, i64), (f64, f64)) {
    if points.is_empty() {
        return ((0, 2), (0.0, 1.0));
    }
    let (x0, x1) = points
        .iter()
        .fold((i64::MAX, i64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = points
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let x1 = x1.max(x0 + 1);
    let x1 = x1 + ((x1 - x0) / 4).max(1);
    let min_span = (0.05 * y0.abs().max(y1.abs())).max(1e-6);
    let y = if y1 - y0 < min_span {
        let mid = (y0 + y1) / 2.0;
        (mid - min_span / 2.0, mid + min_span / 2.0)
    } else {
        (y0, y1)
    };
    ((x0, x1), y)
}

/// (columns, rows) of the plot's panels: one column up to 2 metrics, then 2, then 3.
fn grid(n: usize) -> (u32, u32) {
    let n = n.max(1) as u32;
    let cols = match n {
        1..=2 => 1,
        3..=4 => 2,
        _ => 3,
    };
    (cols, n.div_ceil(cols))
}

/// The metrics a comparison shows when none is named: every validation metric the runs share
/// and the main training figures, else the first few shared metrics.
pub fn primary_metrics(common: &[String]) -> Vec<String> {
    const MAIN: &[&str] = &[
        "critic/score/mean",
        "actor/pg_loss",
        "train/loss",
        "rm/accuracy",
        "rewards/accuracies",
    ];
    let mut out: Vec<String> = common
        .iter()
        .filter(|k| k.starts_with("val/"))
        .cloned()
        .collect();
    out.extend(
        MAIN.iter()
            .filter(|k| common.iter().any(|c| c == *k))
            .map(|k| k.to_string()),
    );
    if out.is_empty() {
        out = common.iter().take(6).cloned().collect();
    }
    out
}

/// Plots each metric's curves across runs (one panel per metric, in a grid of up to three
/// columns) to `file`: `.svg` or `.png`.
pub fn plot(file: &Path, curves: &Curves, smoothing: f64) -> Result<()> {
    use plotters::prelude::*;
    register_font()?;
    let ext = file
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let (cols, rows) = grid(curves.len());
    let size = (if cols == 1 { 900 } else { 600 * cols }, 320 * rows);
    if let Some(dir) = file.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the plot's folder {}", dir.display()))?;
    }
    match ext.as_str() {
        "svg" => draw(
            SVGBackend::new(file, size).into_drawing_area(),
            curves,
            smoothing,
        ),
        "png" => draw(
            BitMapBackend::new(file, size).into_drawing_area(),
            curves,
            smoothing,
        ),
        _ => bail!("plot file {} must end in .svg or .png", file.display()),
    }
    .with_context(|| format!("drawing {}", file.display()))
}

fn draw<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    curves: &Curves,
    smoothing: f64,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e}");
    root.fill(&WHITE).map_err(e)?;
    let (cols, rows) = grid(curves.len());
    let panels = root.split_evenly((rows as usize, cols as usize));
    for ((metric, runs), area) in curves.iter().zip(panels.iter()) {
        let points: Vec<(i64, f64)> = runs
            .iter()
            .flat_map(|(_, s)| s.iter().copied())
            .filter(|p| p.1.is_finite())
            .collect();
        let ((x0, x1), (y0, y1)) = axes(&points);
        let pad = (y1 - y0) * 0.05;
        let caption = if smoothing > 0.0 {
            format!("{metric} (smoothed, weight {smoothing})")
        } else {
            metric.clone()
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
            .map_err(e)?;
        chart.configure_mesh().x_desc("step").draw().map_err(e)?;
        for (i, (label, series)) in runs.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let data: Vec<(i64, f64)> = smooth(series, smoothing)
                .into_iter()
                .filter(|p| p.1.is_finite())
                .collect();
            // a few points (validations) get markers, so that a line is not read as data
            if data.len() <= 20 {
                chart
                    .draw_series(
                        data.iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )
                    .map_err(e)?;
            }
            chart
                .draw_series(LineSeries::new(data, color.stroke_width(2)))
                .map_err(e)?
                .label(label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 19: a curve that moves within rounding is not stretched over the whole panel, and
    /// the legend has room right of the last step.
    #[test]
    fn axes_widen_a_flat_band_and_leave_room_for_the_legend() {
        let flat = [(1, 0.500_01), (2, 0.5), (40, 0.500_02)];
        let ((x0, x1), (y0, y1)) = axes(&flat);
        assert_eq!((x0, x1), (1, 49), "a quarter of the 39 steps more");
        assert!((y1 - y0 - 0.05 * 0.500_02).abs() < 1e-12, "{y0}..{y1}");
        assert!(y0 < 0.5 && y1 > 0.500_02);
        // a real trend keeps its range
        let trend = [(0, 0.2), (10, 0.8)];
        assert_eq!(axes(&trend).1, (0.2, 0.8));
        // an all-zero series still gets a span
        let ((_, _), (z0, z1)) = axes(&[(0, 0.0), (5, 0.0)]);
        assert!(z1 > z0);
    }
}
