//! The projection plot of `odc-bench sim --plot`: speedup against device count, as ODC's figure.
//!
//! Two stacked panels share a logarithmic device axis whose ticks are the device counts present:
//!
//! - **(a) speedup**: on-demand over collective tokens/s of the runtime rows ([`BenchRow`], the
//!   real job on the virtual clock), one line with markers per workload (the balanced control
//!   included: it should sit on 1.00), and a dashed parity line at 1.0.
//! - **(b) fraction of a bound**: per workload, in its panel-(a) colour, on-demand over the
//!   achievable bound (runtime; solid, with markers), and from the split table ([`SplitRow`], the
//!   model) the projected step-time efficiency against perfect balance without splitting (long
//!   dashes) and with context-parallel splitting (short dashes).
//!
//! The title says what is projected (the runtime on the virtual clock, splitting from the model)
//! and from which profile and how many blocks.
//!
//! Guarantees: rendering is a pure function of its arguments and never panics on any rows —
//! none, one, or rows holding `NaN`, infinite values or zero devices: such points are left out
//! (with nothing left to draw the panels say "no rows"); values of panel (b) are clamped to its
//! axis. Within a line, points are drawn in ascending device order, so x grows with devices.
//! Text is SVG `<text>` (no fonts embedded).

use std::path::Path;

use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::report::SplitRow;
use crate::report::{draw_no_rows, Area, BenchRow, DrawError, ReportError};

/// Plot size in pixels.
const SIZE: (u32, u32) = (1100, 1000);
/// Top of panel (b)'s axis (room above 1.0 for the legend).
const FRACTION_TOP: f64 = 1.3;
/// Panel (a)'s axis never reaches above this speedup (larger ones are drawn at the top).
const SPEEDUP_TOP: f64 = 1e6;
/// Line colours, one per workload in order of first appearance (the balanced control has its own).
const PALETTE: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];
/// Colour of the balanced control.
const CONTROL: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
/// Colour of the parity line.
const PARITY: RGBColor = RGBColor(0x60, 0x60, 0x60);

/// Writes [`render`]'s SVG to `path`.
pub fn write(
    path: &Path,
    profile: &str,
    blocks: u32,
    runtime: &[BenchRow],
    split: &[SplitRow],
) -> Result<(), ReportError> {
    crate::report::write_rendered(path, render(profile, blocks, runtime, split))
}

/// One line: `(devices, value)` points with finite values and positive device counts, ascending
/// in devices.
fn line(points: impl IntoIterator<Item = (usize, f64)>) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = points
        .into_iter()
        .filter(|&(d, v)| d > 0 && v.is_finite())
        .map(|(d, v)| (d as f64, v))
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// The workloads of `runtime` then of `split`, in order of first appearance.
fn workloads(runtime: &[BenchRow], split: &[SplitRow]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let names = runtime
        .iter()
        .map(|r| &r.workload)
        .chain(split.iter().map(|s| &s.workload));
    for name in names {
        if !out.contains(name) {
            out.push(name.clone());
        }
    }
    out
}

/// The plot's colour of workload number `i` named `name`.
fn colour(i: usize, name: &str) -> RGBColor {
    if name == "balanced" {
        CONTROL
    } else {
        PALETTE[i % PALETTE.len()]
    }
}

/// What the panels draw: per workload, its lines.
struct Lines {
    /// Workloads in order of first appearance.
    names: Vec<String>,
    /// Panel (a): speedup per workload.
    speedups: Vec<Vec<(f64, f64)>>,
    /// Panel (b): on-demand / achievable, unsplit / perfect, split / perfect per workload.
    of_achievable: Vec<Vec<(f64, f64)>>,
    unsplit: Vec<Vec<(f64, f64)>>,
    with_split: Vec<Vec<(f64, f64)>>,
    /// The device counts present, ascending.
    ticks: Vec<f64>,
}

impl Lines {
    fn new(runtime: &[BenchRow], split: &[SplitRow]) -> Lines {
        let names = workloads(runtime, split);
        let of_runtime = |f: fn(&BenchRow) -> f64| -> Vec<Vec<(f64, f64)>> {
            names
                .iter()
                .map(|w| {
                    line(
                        runtime
                            .iter()
                            .filter(|r| &r.workload == w)
                            .map(|r| (r.devices, f(r))),
                    )
                })
                .collect()
        };
        let of_model = |f: fn(&SplitRow) -> f64| -> Vec<Vec<(f64, f64)>> {
            names
                .iter()
                .map(|w| {
                    line(
                        split
                            .iter()
                            .filter(|s| &s.workload == w)
                            .map(|s| (s.devices as usize, f(s))),
                    )
                })
                .collect()
        };
        let speedups = of_runtime(|r| r.speedup);
        let of_achievable = of_runtime(|r| r.ondemand_of_achievable().unwrap_or(f64::NAN));
        let unsplit = of_model(SplitRow::unsplit_efficiency);
        let with_split = of_model(SplitRow::split_efficiency);
        let mut ticks: Vec<f64> = [&speedups, &of_achievable, &unsplit, &with_split]
            .into_iter()
            .flatten()
            .flatten()
            .map(|p| p.0)
            .collect();
        ticks.sort_by(f64::total_cmp);
        ticks.dedup();
        Lines {
            names,
            speedups,
            of_achievable,
            unsplit,
            with_split,
            ticks,
        }
    }
}

/// The SVG of the module docs, or the plotting library's message.
pub fn render(
    profile: &str,
    blocks: u32,
    runtime: &[BenchRow],
    split: &[SplitRow],
) -> Result<String, String> {
    let title = format!(
        "odc-bench sim, projected (runtime on the virtual clock, splitting modelled): profile {profile} × {blocks} blocks"
    );
    let lines = Lines::new(runtime, split);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        draw(&root, &title, &lines).map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// A dashed line's legend sample (`dash` 0: solid).
fn legend_line(
    x: i32,
    y: i32,
    dash: u32,
) -> DashedPathElement<std::vec::IntoIter<(i32, i32)>, u32> {
    let dash = if dash == 0 { 24 } else { dash };
    DashedPathElement::new(vec![(x, y), (x + 24, y)], dash, 4, BLACK.stroke_width(2))
}

/// Draws `lines` on `root` under `title`.
fn draw(root: &Area<'_>, title: &str, lines: &Lines) -> Result<(), DrawError> {
    root.fill(&WHITE)?;
    let body = root.titled(title, ("sans-serif", 19))?;
    let ticks = &lines.ticks;
    let (Some(&lo), Some(&hi)) = (ticks.first(), ticks.last()) else {
        return draw_no_rows(&body);
    };
    let x_range = || {
        (lo / 1.5..hi * 1.5)
            .log_scale()
            .with_key_points(ticks.clone())
    };
    let x_label = |x: &f64| format!("{x:.0}");
    let (top, bottom) = body.split_vertically(body.dim_in_pixel().1 / 2);

    // (a) Speedup: the axis spans parity and every finite speedup (at most SPEEDUP_TOP).
    let finite = lines.speedups.iter().flatten().map(|p| p.1);
    let y_lo = finite.clone().fold(1.0f64, f64::min).max(0.0) * 0.9;
    let y_hi = finite.fold(1.0f64, f64::max).min(SPEEDUP_TOP) * 1.15;
    let mut chart = ChartBuilder::on(&top)
        .caption(
            "(a) speedup of on-demand over collective (tokens/s; runtime, virtual time)",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range(), y_lo..y_hi)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc("devices")
        .x_label_formatter(&x_label)
        .y_desc("speedup (×)")
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()?;
    chart
        .draw_series(DashedLineSeries::new(
            [(lo / 1.5, 1.0), (hi * 1.5, 1.0)],
            8,
            6,
            PARITY.stroke_width(2),
        ))?
        .label("parity (1.0)")
        .legend(|(x, y)| legend_line(x, y, 8));
    for (i, (name, points)) in lines.names.iter().zip(&lines.speedups).enumerate() {
        let c = colour(i, name);
        let points: Vec<(f64, f64)> = points
            .iter()
            .map(|&(d, v)| (d, v.clamp(y_lo, y_hi)))
            .collect();
        chart.draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))?;
        // The control: a wider ring, visible around the markers of workloads at 1.00.
        let (label, marker) = if name == "balanced" {
            ("balanced (control)".to_string(), (8, c.stroke_width(2)))
        } else {
            (name.clone(), (5, c.filled()))
        };
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, marker.0, marker.1)))?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 9, y), marker.0, marker.1));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;

    // (b) Fractions of a bound, clamped to the axis.
    let mut chart = ChartBuilder::on(&bottom)
        .caption(
            "(b) on-demand / achievable (runtime, solid); step time vs perfect balance without (long dashes) and with (short dashes) context-parallel splitting (model)",
            ("sans-serif", 14),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range(), 0.0..FRACTION_TOP)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc("devices")
        .x_label_formatter(&x_label)
        .y_desc("fraction of the bound")
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()?;
    let clamp = |points: &[(f64, f64)]| -> Vec<(f64, f64)> {
        points
            .iter()
            .map(|&(d, v)| (d, v.clamp(0.0, FRACTION_TOP)))
            .collect()
    };
    for (i, name) in lines.names.iter().enumerate() {
        let c = colour(i, name);
        let solid = clamp(&lines.of_achievable[i]);
        chart.draw_series(LineSeries::new(solid.iter().copied(), c.stroke_width(2)))?;
        chart.draw_series(solid.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
        for (points, dash) in [(&lines.unsplit[i], 10), (&lines.with_split[i], 3)] {
            let points = clamp(points);
            chart.draw_series(DashedLineSeries::new(
                points.iter().copied(),
                dash,
                5,
                c.stroke_width(2),
            ))?;
            chart.draw_series(points.iter().map(|&p| Cross::new(p, 4, c.stroke_width(2))))?;
        }
    }
    // The legend names the line styles; the colours are panel (a)'s.
    for (label, dash) in [
        ("on-demand / achievable (runtime)", 0),
        ("unsplit / perfect (model)", 10),
        ("split / perfect (model)", 3),
    ] {
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label(label)
            .legend(move |(x, y)| legend_line(x, y, dash));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::runtime_row;

    fn split_row(workload: &str, devices: u32, unsplit_s: f64, split_s: f64) -> SplitRow {
        SplitRow {
            workload: workload.into(),
            devices,
            samples: 4 * devices as usize,
            perfect_s: 1.0,
            achievable_unsplit_s: unsplit_s,
            unsplit_s,
            split_s,
            placement: "gangs".into(),
            gangs_s: split_s,
            splits: 1,
            shortest_split_tokens: Some(32_768),
            widest_split: Some(2),
            fsdp_s: None,
            static_cp: None,
            te_cp: None,
            dynamic_cp_s: None,
        }
    }

    /// The trimmed content of every `<text>`, in document order.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = t.split_once('>')?.1;
                Some(body.split("</text>").next()?.trim().to_string())
            })
            .collect()
    }

    /// The `cx` of every `<circle>`, in document order.
    fn circle_xs(svg: &str) -> Vec<f64> {
        svg.split("<circle")
            .skip(1)
            .filter_map(|c| {
                let rest = c.split("cx=\"").nth(1)?;
                rest.split('"').next()?.parse().ok()
            })
            .collect()
    }

    #[test]
    fn the_plot_names_every_workload_its_axes_and_the_profile() {
        let mut runtime = Vec::new();
        for d in [8, 64, 256] {
            runtime.push(runtime_row("longalign", d, 1.3));
            runtime.push(runtime_row("rl", d, 1.4));
            runtime.push(runtime_row("balanced", d, 1.0));
        }
        let split = [
            split_row("longalign", 8, 1.2, 1.1),
            split_row("longalign", 64, 3.0, 1.2),
            split_row("swesmith", 256, 2.0, 1.5),
        ];
        let svg = render("PAPERS.md H100 table, 7b", 28, &runtime, &split).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        let texts = texts(&svg);
        let has = |t: &str| texts.iter().any(|x| x == t);
        for name in ["longalign", "rl", "balanced (control)", "swesmith"] {
            assert!(has(name), "{name} in {texts:?}");
        }
        for text in [
            "speedup (×)",
            "fraction of the bound",
            "parity (1.0)",
            "on-demand / achievable (runtime)",
            "unsplit / perfect (model)",
            "split / perfect (model)",
        ] {
            assert!(has(text), "{text} in {texts:?}");
        }
        assert!(
            texts[0].contains("projected")
                && texts[0].contains("PAPERS.md H100 table, 7b × 28 blocks"),
            "title: {}",
            texts[0]
        );
        // Both panels: the device axis, a tick per device count present.
        for tick in ["devices", "8", "64", "256"] {
            assert_eq!(
                texts.iter().filter(|x| *x == tick).count(),
                2,
                "{tick} in {texts:?}"
            );
        }
    }

    #[test]
    fn x_positions_grow_with_devices() {
        // Rows out of order: the line is drawn in ascending device order.
        let runtime = [
            runtime_row("longalign", 256, 1.3),
            runtime_row("longalign", 8, 1.1),
            runtime_row("longalign", 64, 1.2),
        ];
        let svg = render("p", 1, &runtime, &[]).unwrap();
        let xs = circle_xs(&svg);
        // Panel (a)'s three markers, its legend's marker, then panel (b)'s three markers.
        assert_eq!(xs.len(), 7, "{xs:?}");
        assert!(
            xs[..3].windows(2).all(|w| w[0] < w[1]),
            "x must grow with devices: {xs:?}"
        );
        // The same x in panel (b) for the same device count.
        assert_eq!(xs[..3], xs[4..7]);
    }

    #[test]
    fn rendering_never_panics_on_no_rows_or_non_finite_values() {
        let empty = render("p", 28, &[], &[]).unwrap();
        assert!(empty.starts_with("<svg") && empty.contains("no rows"));
        // Nothing finite to draw is no rows too.
        let nothing = render(
            "p",
            28,
            &[runtime_row("rl", 8, f64::NAN), runtime_row("rl", 0, 1.2)],
            &[split_row("rl", 0, 1.0, 1.0)],
        )
        .unwrap();
        assert!(nothing.contains("no rows"));
        let odd = render(
            "p",
            0,
            &[
                runtime_row("rl", 8, f64::INFINITY),
                runtime_row("rl", 16, f64::NAN),
                runtime_row("rl", 32, -1.0),
                runtime_row("rl", 64, 1e300),
                runtime_row("balanced", 64, 1.0),
            ],
            &[
                split_row("rl", 8, f64::NAN, 1.0),
                split_row("rl", 16, f64::INFINITY, f64::NEG_INFINITY),
                split_row("rl", 64, 0.0, 0.0),
            ],
        )
        .unwrap();
        assert!(odd.starts_with("<svg") && !odd.contains("no rows"));
        assert!(
            !odd.contains("NaN") && !odd.contains("inf"),
            "no non-finite coordinates"
        );
    }

    #[test]
    fn write_names_the_path_it_cannot_write() {
        let path = Path::new("/nonexistent-odc-dir/sim.svg");
        let e = write(path, "p", 1, &[], &[]).unwrap_err();
        assert!(
            e.to_string().contains("/nonexistent-odc-dir/sim.svg"),
            "{e}"
        );
    }
}
