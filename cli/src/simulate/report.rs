//! The report of a simulation: one row per policy and pool size ([`PolicyRun`]), the whole
//! report ([`SimReport`]), its table and its SVG plot.

use super::{ratio, two_level};
use crate::error::Error;
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Instant;

/// One policy at one pool size.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PolicyRun {
    /// The variant's label ([`Variant::label`](super::Variant::label); `optimum` for the offline bound, `foresight-R` for
    /// the foresight reference of horizon `R`).
    pub policy: String,
    /// Chain-aware victims.
    pub chain: bool,
    /// Requests hinted ahead (0: no hints).
    pub lookahead: usize,
    /// Queue-protecting admission ([`Variant::protect`](super::Variant::protect)).
    pub protect: bool,
    /// Pool size in slots.
    pub slots: u32,
    /// Pages found by queries.
    pub hit_pages: u64,
    /// `hit_pages / pages`.
    pub hit_ratio: f64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Missing pages not saved (did not fit, or refused).
    pub dropped_pages: u64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
    /// Mean time of `tier.query` per request in ns (0 for the optimum).
    pub query_ns: f64,
    /// Mean time of the save call (index probes, slot acquisition with eviction, submission) per
    /// request that saved, in ns (0 for the optimum).
    pub save_ns: f64,
    /// Mean time per request of its hint calls (one `hint` as it joins the queue, one
    /// `withdraw_hint` as it leaves), in ns (0 without hints).
    pub hint_ns: f64,
}

impl PolicyRun {
    /// The row of an offline computation (no tier: no evictions, drops or per-request costs) named
    /// `policy` at `slots` slots: `hits` of `total` pages, timed from `t0`.
    pub(super) fn offline(policy: String, slots: u32, hits: u64, total: u64, t0: Instant) -> Self {
        PolicyRun {
            policy,
            chain: false,
            lookahead: 0,
            protect: false,
            slots,
            hit_pages: hits,
            hit_ratio: ratio(hits, total),
            evictions: 0,
            dropped_pages: 0,
            wall_s: t0.elapsed().as_secs_f64(),
            query_ns: 0.0,
            save_ns: 0.0,
            hint_ns: 0.0,
        }
    }

    /// True for the rows computed offline from the whole trace (the optimum and the foresight
    /// references), which run no tier.
    pub fn is_offline(policy: &str) -> bool {
        policy == "optimum" || policy.starts_with("foresight-")
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Trace path.
    pub trace: String,
    /// Requests simulated.
    pub requests: u64,
    /// Full pages over all requests.
    pub pages: u64,
    /// Geometry preset.
    pub geometry: String,
    /// Bytes per slot of the geometry.
    pub slot_bytes: u64,
    /// Pool sizes: (label as given, slots).
    pub sizes: Vec<(String, u32)>,
    /// Every policy x size, then the foresight references per horizon and size, then the optimum per
    /// size.
    pub runs: Vec<PolicyRun>,
    /// SSD tier sizes: (label as given, disk slots); empty without `--ssd`.
    pub ssd_sizes: Vec<(String, u32)>,
    /// SSD admissions run (`"1"`, `"2"`, `"auto"`).
    pub ssd_admit: Vec<String>,
    /// Every variant x host pool size x SSD size (empty without `--ssd`).
    pub two_level: Vec<two_level::TwoLevelRun>,
    /// Page hit ratio of an unbounded cache ([`two_level::unbounded`]).
    pub unbounded_hit_ratio: f64,
    /// Peak resident memory of the process in KiB (Linux `VmHWM`), 0 if unknown.
    pub peak_rss_kib: u64,
}

impl SimReport {
    fn policies(&self) -> Vec<&str> {
        let mut v: Vec<&str> = Vec::new();
        for r in &self.runs {
            if !v.contains(&r.policy.as_str()) {
                v.push(&r.policy);
            }
        }
        v
    }

    fn get(&self, policy: &str, slots: u32) -> Option<&PolicyRun> {
        self.runs.iter().find(|r| r.policy == policy && r.slots == slots)
    }

    /// The report as a text table: page hit ratio per variant and size, then each variant's ratio
    /// to plain LRU and to the optimum, then the per-request query and save cost (and hint cost
    /// with a lookahead).
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "trace {}: {} requests, {} pages; geometry {} ({} B per slot); peak RSS {} MiB",
            self.trace,
            self.requests,
            self.pages,
            self.geometry,
            self.slot_bytes,
            self.peak_rss_kib / 1024
        );
        let w = self.policies().iter().map(|p| p.len()).max().unwrap_or(0).max(16);
        let head = |s: &mut String, title: &str| {
            let _ = write!(s, "\n{title:<w$}");
            for (label, slots) in &self.sizes {
                let _ = write!(s, " {:>18}", format!("{label} ({slots})"));
            }
            let _ = writeln!(s);
        };
        head(&mut s, "hit ratio");
        for p in self.policies() {
            let _ = write!(s, "{p:<w$}");
            for (_, slots) in &self.sizes {
                let v = self.get(p, *slots).map_or("-".into(), |r| format!("{:.4}", r.hit_ratio));
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        head(&mut s, "x LRU / %opt");
        for p in self.policies() {
            let _ = write!(s, "{p:<w$}");
            for (_, slots) in &self.sizes {
                let r = self.get(p, *slots);
                let l = self.get("lru", *slots);
                let o = self.get("optimum", *slots);
                let v = match r {
                    Some(r) => format!(
                        "{} / {}",
                        l.map_or("-".into(), |l| format!("{:.2}x", r.hit_ratio / l.hit_ratio)),
                        o.map_or("-".into(), |o| format!("{:.0}%", 100.0 * r.hit_ratio / o.hit_ratio))
                    ),
                    None => "-".into(),
                };
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        let hints = self.runs.iter().any(|r| r.lookahead > 0);
        head(&mut s, if hints { "query/save/hint us" } else { "query/save us" });
        for p in self.policies().into_iter().filter(|p| !PolicyRun::is_offline(p)) {
            let _ = write!(s, "{p:<w$}");
            for (_, slots) in &self.sizes {
                let v = self.get(p, *slots).map_or("-".into(), |r| {
                    let mut v = format!("{:.1} / {:.1}", r.query_ns / 1e3, r.save_ns / 1e3);
                    if hints {
                        let _ = write!(v, " / {:.1}", r.hint_ns / 1e3);
                    }
                    v
                });
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        if !self.two_level.is_empty() {
            s.push_str(&self.two_level_table(w));
        }
        s
    }

    /// The two-level section of [`SimReport::table`]: per variant and host pool size, the host-only
    /// ratio, then for each SSD size the two-level ratio with its host and SSD shares.
    fn two_level_table(&self, w: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\ntwo-level page hit ratio: host pool + SSD tier = host share + SSD share (SSD admission after \
             N uses, or auto); unbounded cache {:.4}",
            self.unbounded_hit_ratio
        );
        let _ = write!(s, "{:<w$} {:>6} {:>18} {:>12}", "policy", "admit", "host pool", "host only");
        for (label, slots) in &self.ssd_sizes {
            let _ = write!(s, " {:>26}", format!("+ SSD {label} ({slots})"));
        }
        let _ = writeln!(s);
        for p in self.policies().into_iter().filter(|p| !PolicyRun::is_offline(p)) {
            for (label, slots) in &self.sizes {
                for admit in &self.ssd_admit {
                    let alone = self.get(p, *slots).map_or("-".into(), |r| format!("{:.4}", r.hit_ratio));
                    let _ = write!(s, "{p:<w$} {admit:>6} {:>18} {alone:>12}", format!("{label} ({slots})"));
                    for (_, ssd) in &self.ssd_sizes {
                        let v = self
                            .two_level
                            .iter()
                            .find(|r| {
                                r.policy == p && r.host_slots == *slots && r.ssd_slots == *ssd && r.admit == *admit
                            })
                            .map_or("-".into(), |r| {
                                format!("{:.4} = {:.4} + {:.4}", r.hit_ratio, r.host_hit_ratio, r.ssd_hit_ratio)
                            });
                        let _ = write!(s, " {v:>26}");
                    }
                    let _ = writeln!(s);
                }
            }
        }
        s
    }

    /// The variants the plot draws: all of them when there are at most 12; else plain `lru` (the
    /// baseline), each policy's chain-aware variant with and without hints (its plain variant when
    /// it has no chain-aware one), and the optimum.
    fn plotted(&self) -> Vec<&str> {
        let all = self.policies();
        if all.len() <= 12 {
            return all;
        }
        let chain_of = |p: &str| format!("{}+chain", p.split('+').next().unwrap_or(p));
        all.iter()
            .copied()
            .filter(|p| {
                let base = p.split('+').next().unwrap_or(p);
                let has_chain = all.iter().any(|q| q.starts_with(&chain_of(p)));
                PolicyRun::is_offline(p)
                    || *p == "lru"
                    || p.starts_with(&chain_of(p))
                    || (!has_chain && (*p == base || p.strip_prefix(base).is_some_and(|r| r.starts_with("+la"))))
            })
            .collect()
    }

    /// An SVG line plot (drawn with plotters) of page hit ratio (y) against pool size in slots
    /// (x, log scale), one line per variant (see `SimReport::plotted`: at most one chain setting
    /// per policy when there are many), one colour per policy, hinted runs and the optimum dashed.
    ///
    /// # Errors
    /// [`Error::Plot`] if plotters fails to lay the chart out.
    pub fn svg(&self) -> Result<String, Error> {
        let mut out = String::new();
        self.draw(&mut out).map_err(|e| Error::Plot(e.to_string()))?;
        Ok(out)
    }

    fn draw(&self, out: &mut String) -> Result<(), Box<dyn std::error::Error + '_>> {
        use plotters::prelude::*;
        let size = if self.plotted().len() > 8 { (980, 620) } else { (760, 460) };
        let root = SVGBackend::with_string(out, size).into_drawing_area();
        root.fill(&WHITE)?;
        let slots: Vec<f64> = self.sizes.iter().map(|(_, n)| *n as f64).collect();
        let (lo, hi) = slots.iter().fold((f64::MAX, 1f64), |(a, b), &n| (a.min(n), b.max(n)));
        // A margin of a fifth of a doubling on each side; one size still gets a range.
        let (lo, hi) = (lo.min(hi) / 1.15, hi * 1.15);
        let ymax = (self.runs.iter().map(|r| r.hit_ratio).fold(0.0, f64::max) * 1.1).clamp(0.05, 1.0);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("Page hit ratio vs host pool size ({}, {} requests)", self.geometry, self.requests),
                ("sans-serif", 16),
            )
            .margin(14)
            .x_label_area_size(42)
            .y_label_area_size(56)
            .build_cartesian_2d((lo..hi).log_scale().with_key_points(slots), 0f64..ymax)?;
        // Each pool size is a tick, labelled as given.
        let label = |x: &f64| match self.sizes.iter().find(|(_, n)| *n as f64 == *x) {
            Some((label, _)) => label.clone(),
            None => format!("{x:.0}"),
        };
        chart
            .configure_mesh()
            .x_desc("pool size (log scale)")
            .y_desc("page hit ratio")
            .x_label_formatter(&label)
            .y_label_formatter(&|y| format!("{y:.3}"))
            .draw()?;
        // One colour per policy; hinted runs dashed; the optimum dashed black.
        let mut bases: Vec<String> = Vec::new();
        for p in self.plotted() {
            let points: Vec<(f64, f64)> =
                self.sizes.iter().filter_map(|(_, n)| self.get(p, *n).map(|r| (*n as f64, r.hit_ratio))).collect();
            let base = p.split('+').next().unwrap_or(p).to_string();
            let i = bases.iter().position(|b| *b == base).unwrap_or_else(|| {
                bases.push(base.clone());
                bases.len() - 1
            });
            let hinted = self.runs.iter().any(|r| r.policy == p && r.lookahead > 0);
            let color = if p == "optimum" { BLACK.to_rgba() } else { Palette99::pick(i).to_rgba() };
            let line = color.stroke_width(2);
            if PolicyRun::is_offline(p) || hinted {
                let legend = move |(x, y): (i32, i32)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(0, 0), (8, 0)], line)
                        + PathElement::new(vec![(13, 0), (21, 0)], line)
                };
                chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, line))?.label(p).legend(legend);
            } else {
                let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 24, y)], line);
                chart.draw_series(LineSeries::new(points.clone(), line))?.label(p).legend(legend);
            }
            chart.draw_series(points.iter().map(|&xy| Circle::new(xy, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}
