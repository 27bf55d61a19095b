//! Results of the on-demand vs collective benchmark: rows, their JSON form, a text table and an SVG
//! plot, plus the derived quantities the benchmark reports (utilization, the perfect-balance bound,
//! rates and ratios that never come out infinite).
//!
//! # Guarantees
//!
//! - **Schema.** [`BenchReport`] serialises as `{"rows":[{...}]}` with exactly the field names of
//!   [`BenchRow`]; [`BenchReport::from_json`] reads back what [`BenchReport::to_json`] wrote.
//! - **No infinities from the helpers.** [`utilization`], [`bound_tokens_per_s`] and [`rate`]
//!   return `0.0` instead of `inf` or `NaN` when there are no devices, no time, or non-finite
//!   inputs.
//! - **Rendering never panics.** [`format_table`] and [`write_svg`] accept any rows, including none,
//!   one, and rows holding `NaN` or infinite values (shown as `n/a` in the table, left out of the
//!   plot). Failures to write are errors naming the path.

use std::path::{Path, PathBuf};

use plotters::coord::combinators::WithKeyPoints;
use plotters::coord::types::{RangedCoordf64, RangedCoordi64};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontTransform;

/// Relative excess over 1 that [`utilization`] treats as floating-point noise and clamps away.
const UTILIZATION_TOLERANCE: f64 = 1e-9;

/// What went wrong producing or reading a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading or writing a file failed.
    #[error("cannot write {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// JSON that is not a benchmark report (the source names line and column).
    #[error("not a benchmark report")]
    Json(#[from] serde_json::Error),
    /// The plotting library failed to draw.
    #[error("cannot plot {}: {message}", path.display())]
    Plot {
        /// The SVG file being drawn.
        path: PathBuf,
        /// The plotting library's message.
        message: String,
    },
}

/// One cell of the benchmark matrix: a workload at a device count and minibatch size, run in both
/// modes on the same samples.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BenchRow {
    /// Workload name ([`crate::workload::Workload::name`]).
    pub workload: String,
    /// Number of (simulated) devices, one trainer each.
    pub devices: usize,
    /// Samples per device per minibatch.
    pub minibatch_per_device: usize,
    /// Dispatch of the on-demand mode (for example `static` or `dynamic`).
    pub dispatch: String,
    /// The collective baseline: `fsdp` (LB-Micro, no context parallelism), `cp2`, `cp4`, `cp8`
    /// (static context parallelism) or `dcp` (dynamic, Megatron-Core's hybrid CP).
    #[serde(default = "fsdp")]
    pub baseline: String,
    /// Throughput of the collective baseline.
    pub collective_tokens_per_s: f64,
    /// Throughput of on-demand mode.
    pub ondemand_tokens_per_s: f64,
    /// `ondemand_tokens_per_s / collective_tokens_per_s`.
    pub speedup: f64,
    /// [`utilization`] of the collective run.
    pub collective_utilization: f64,
    /// [`utilization`] of the on-demand run.
    pub ondemand_utilization: f64,
    /// The perfect-balance bound, [`bound_tokens_per_s`]: as if samples could be split.
    pub bound_tokens_per_s: f64,
    /// The achievable bound: tokens over the sum, per step, of the larger of (total modelled
    /// compute / joint device capacity) and (the costliest sample's modelled time on the fastest
    /// device). At most `bound_tokens_per_s`.
    pub achievable_bound_tokens_per_s: f64,
    /// `ondemand_tokens_per_s / achievable_bound_tokens_per_s` (0 when the bound is not positive).
    pub ondemand_over_achievable: f64,
    /// Speedup of the balanced control at the same devices, minibatch per device and dispatch
    /// (a balanced row's own); 1.00 when the comparison is fair. `null` without a control.
    pub control_speedup: Option<f64>,
    /// Set when the row's shortest modelled compute span is too short next to the measured
    /// emulation floor (see [`crate::floor`]); names a faithful `--time-scale-ms`. `null` otherwise.
    pub emulation_warning: Option<String>,
}

/// The baseline of a row written before baselines existed.
fn fsdp() -> String {
    "fsdp".into()
}

impl BenchRow {
    /// Short label `workload/devices/minibatch_per_device/dispatch` used on plot axes (with
    /// ` vs <baseline>` against a context-parallel baseline).
    pub fn label(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            self.workload,
            self.devices,
            self.minibatch_per_device,
            self.sides()
        )
    }

    /// The dispatch column: the on-demand dispatch, and ` vs <baseline>` when the collective
    /// baseline is not plain FSDP.
    pub fn sides(&self) -> String {
        if self.baseline == "fsdp" || self.baseline.is_empty() {
            self.dispatch.clone()
        } else {
            format!("{} vs {}", self.dispatch, self.baseline)
        }
    }

    /// On-demand throughput as a fraction of the perfect-balance bound; `None` when the bound is
    /// not positive or either value is not finite.
    pub fn ondemand_of_bound(&self) -> Option<f64> {
        let ratio = self.ondemand_tokens_per_s / self.bound_tokens_per_s;
        (self.bound_tokens_per_s > 0.0 && ratio.is_finite()).then_some(ratio)
    }

    /// On-demand throughput as a fraction of the achievable bound; `None` when that bound is not
    /// positive or either value is not finite.
    pub fn ondemand_of_achievable(&self) -> Option<f64> {
        let ratio = self.ondemand_tokens_per_s / self.achievable_bound_tokens_per_s;
        (self.achievable_bound_tokens_per_s > 0.0 && ratio.is_finite()).then_some(ratio)
    }
}

/// All rows of one benchmark run; the `--json` file.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BenchReport {
    /// One row per cell of the matrix, in the order run.
    pub rows: Vec<BenchRow>,
}

impl BenchReport {
    /// Pretty-printed JSON, `{"rows":[...]}`. Non-finite numbers become `null` (JSON has no `NaN`),
    /// which [`BenchReport::from_json`] then rejects.
    pub fn to_json(&self) -> String {
        rows_json(self)
    }

    /// Parses a report written by [`BenchReport::to_json`].
    ///
    /// ```
    /// use odc_bench::report::BenchReport;
    /// let r = BenchReport::from_json(r#"{"rows":[]}"#).unwrap();
    /// assert!(r.rows.is_empty());
    /// assert!(BenchReport::from_json(r#"{"rows":[{"workload":1}]}"#).is_err());
    /// ```
    pub fn from_json(json: &str) -> Result<Self, ReportError> {
        Ok(serde_json::from_str(json)?)
    }

    /// Writes [`BenchReport::to_json`] (plus a final newline) to `path`.
    pub fn write_json(&self, path: &Path) -> Result<(), ReportError> {
        write_file(path, self.to_json() + "\n")
    }
}

/// Pretty-printed JSON of a `{"rows":[...]}` report. Serialising plain structs of strings and
/// numbers into a String cannot fail; this falls back to the compact form of an empty report
/// rather than panic.
pub(crate) fn rows_json(report: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(report).unwrap_or_else(|_| String::from("{\"rows\":[]}"))
}

/// Writes `contents` to `path`; an error names `path`.
pub(crate) fn write_file(path: &Path, contents: impl AsRef<[u8]>) -> Result<(), ReportError> {
    std::fs::write(path, contents).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `tokens / seconds`, or `0.0` when `seconds` is not a positive finite number or the quotient is
/// not finite.
///
/// ```
/// use odc_bench::report::rate;
/// assert_eq!(rate(1_000, 2.0), 500.0);
/// assert_eq!(rate(1_000, 0.0), 0.0);
/// ```
pub fn rate(tokens: u64, seconds: f64) -> f64 {
    if !(seconds.is_finite() && seconds > 0.0) {
        return 0.0;
    }
    let r = tokens as f64 / seconds;
    if r.is_finite() {
        r
    } else {
        0.0
    }
}

/// `a / b`, or `0.0` when `b` is not positive or the quotient is not finite.
///
/// ```
/// use odc_bench::report::ratio;
/// assert_eq!(ratio(3.0, 4.0), 0.75);
/// assert_eq!(ratio(3.0, 0.0), 0.0);
/// ```
pub fn ratio(a: f64, b: f64) -> f64 {
    let r = a / b;
    if b > 0.0 && r.is_finite() {
        r
    } else {
        0.0
    }
}

/// Fraction of device time spent busy: `busy_device_seconds / (devices × wall_seconds)`.
///
/// Returns `0.0` when `devices` is 0, `wall_seconds` is not positive, or an input is not finite.
/// A result above 1 by at most a relative 1e-9 (floating-point noise from summing many spans) is
/// clamped to 1, and one below 0 by as little to 0; larger excursions are returned unchanged, so an
/// accounting error stays visible.
///
/// ```
/// use odc_bench::report::utilization;
/// assert_eq!(utilization(6.0, 4, 2.0), 0.75);
/// assert_eq!(utilization(6.0, 0, 2.0), 0.0);
/// ```
pub fn utilization(busy_device_seconds: f64, devices: usize, wall_seconds: f64) -> f64 {
    if devices == 0
        || wall_seconds.is_nan()
        || wall_seconds <= 0.0
        || !busy_device_seconds.is_finite()
    {
        return 0.0;
    }
    let u = busy_device_seconds / (devices as f64 * wall_seconds);
    if !u.is_finite() {
        return 0.0;
    }
    if u > 1.0 && u <= 1.0 + UTILIZATION_TOLERANCE {
        1.0
    } else if (-UTILIZATION_TOLERANCE..0.0).contains(&u) {
        0.0
    } else {
        u
    }
}

/// The perfect-balance bound on throughput: `total_tokens / (total_cost_seconds / devices)`, as if
/// all work were spread evenly over the devices with no communication and no waiting.
///
/// Returns `0.0` when `devices` is 0, `total_cost_seconds` is not positive or not finite, or the
/// quotient overflows.
///
/// ```
/// use odc_bench::report::bound_tokens_per_s;
/// // 8 devices share 40 s of work: 5 s of wall time at best for 100,000 tokens.
/// assert_eq!(bound_tokens_per_s(100_000, 40.0, 8), 20_000.0);
/// assert_eq!(bound_tokens_per_s(100_000, 0.0, 8), 0.0);
/// ```
pub fn bound_tokens_per_s(total_tokens: u64, total_cost_seconds: f64, devices: usize) -> f64 {
    if devices == 0
        || total_cost_seconds.is_nan()
        || total_cost_seconds <= 0.0
        || !total_cost_seconds.is_finite()
    {
        return 0.0;
    }
    let bound = total_tokens as f64 * devices as f64 / total_cost_seconds;
    if bound.is_finite() {
        bound
    } else {
        0.0
    }
}

/// A fixed-width text table of `rows`: text columns left-aligned, numbers right-aligned, throughput
/// with thousands separators, speedup and the balanced control's speedup as `1.52x`, utilizations
/// and the on-demand/bound and on-demand/achievable ratios with three decimals. Values that are not
/// finite, a ratio to a zero bound and a missing control show as `n/a`.
///
/// ```
/// use odc_bench::report::{format_table, BenchRow};
/// let row = BenchRow {
///     workload: "longalign".into(), devices: 8, minibatch_per_device: 4, dispatch: "dynamic".into(),
///     baseline: "fsdp".into(), collective_tokens_per_s: 100_000.0, ondemand_tokens_per_s: 152_000.0, speedup: 1.52,
///     collective_utilization: 0.61, ondemand_utilization: 0.97, bound_tokens_per_s: 160_000.0,
///     achievable_bound_tokens_per_s: 155_000.0, ondemand_over_achievable: 152.0 / 155.0,
///     control_speedup: Some(1.01), emulation_warning: None,
/// };
/// let table = format_table(&[row]);
/// assert!(table.contains("longalign") && table.contains("1.52x") && table.contains("152,000"));
/// assert!(table.contains("1.01x") && table.contains("0.981"));
/// ```
pub fn format_table(rows: &[BenchRow]) -> String {
    let layout = TableLayout::fit(rows.iter().map(|r| (r.workload.clone(), r.sides())));
    let mut out = layout.header();
    for row in rows {
        out.push_str(&layout.line(row));
        out.push('\n');
    }
    out
}

/// Column titles of the table.
const HEADERS: [&str; 12] = [
    "workload",
    "devices",
    "mb/dev",
    "dispatch",
    "collective tok/s",
    "on-demand tok/s",
    "speedup",
    "control",
    "util coll",
    "util od",
    "od/bound",
    "od/achievable",
];

/// Column widths of the table, fixed before the rows exist so rows printed one at a time line up
/// (a wider number pushes its own line only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLayout {
    widths: [usize; 12],
}

impl TableLayout {
    /// Widths that fit the headers, the given (workload, dispatch) names and numbers up to the
    /// headers' widths.
    pub fn fit<W: AsRef<str>, D: AsRef<str>>(
        names: impl IntoIterator<Item = (W, D)>,
    ) -> TableLayout {
        let mut widths = HEADERS.map(|h| h.chars().count());
        // Room for up to 99,999 devices and samples per device.
        widths[1] = widths[1].max(6);
        widths[2] = widths[2].max(6);
        for (workload, dispatch) in names {
            widths[0] = widths[0].max(workload.as_ref().chars().count());
            widths[3] = widths[3].max(dispatch.as_ref().chars().count());
        }
        TableLayout { widths }
    }

    /// The header line and the rule under it, each ending in a newline.
    pub fn header(&self) -> String {
        let mut out = self.join(&HEADERS.map(String::from));
        out.push('\n');
        let total: usize = self.widths.iter().sum::<usize>() + 2 * (self.widths.len() - 1);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        out
    }

    /// One row's line, without a newline.
    pub fn line(&self, r: &BenchRow) -> String {
        self.join(&[
            r.workload.clone(),
            r.devices.to_string(),
            r.minibatch_per_device.to_string(),
            r.sides(),
            thousands(r.collective_tokens_per_s),
            thousands(r.ondemand_tokens_per_s),
            finite(r.speedup, |v| format!("{v:.2}x")),
            finite(r.control_speedup.unwrap_or(f64::NAN), |v| {
                format!("{v:.2}x")
            }),
            finite(r.collective_utilization, |v| format!("{v:.3}")),
            finite(r.ondemand_utilization, |v| format!("{v:.3}")),
            r.ondemand_of_bound()
                .map_or_else(|| "n/a".to_string(), |v| format!("{v:.3}")),
            r.ondemand_of_achievable()
                .map_or_else(|| "n/a".to_string(), |v| format!("{v:.3}")),
        ])
    }

    /// Cells padded to the widths: text columns (0 and 3) left-aligned, numbers right-aligned.
    fn join(&self, cells: &[String; 12]) -> String {
        let mut out = String::new();
        for (i, (cell, &w)) in cells.iter().zip(&self.widths).enumerate() {
            if i > 0 {
                out.push_str("  ");
            }
            if i == 0 || i == 3 {
                out.push_str(&format!("{cell:<w$}"));
            } else {
                out.push_str(&format!("{cell:>w$}"));
            }
        }
        out.trim_end().to_string()
    }
}

/// `f(v)` for finite `v`, `n/a` otherwise.
fn finite(v: f64, f: impl Fn(f64) -> String) -> String {
    if v.is_finite() {
        f(v)
    } else {
        "n/a".into()
    }
}

/// `v` rounded to an integer with `,` between groups of three digits: `1234567.8` → `1,234,568`.
fn thousands(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 && digits != "0" {
        out.insert(0, '-');
    }
    out
}

/// Smallest plot size in pixels; with many rows the plot widens to [`PIXELS_PER_ROW`] per row.
const SVG_SIZE: (u32, u32) = (1200, 900);
/// Horizontal room per row on wide plots.
const PIXELS_PER_ROW: u32 = 22;
/// Top of the utilization axis (room above 1.0 for the legend).
const UTILIZATION_TOP: f64 = 1.3;
/// Width of one row on the plots' x axis, in axis units.
const SLOT: i64 = 100;
/// Colour of the collective baseline.
const COLLECTIVE: RGBColor = RGBColor(0x9e, 0x9e, 0x9e);
/// Colour of on-demand mode.
const ONDEMAND: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
/// Colour of the parity line and the bound markers.
const REFERENCE: RGBColor = RGBColor(0xd6, 0x27, 0x28);
/// Colour of the balanced control and the achievable-bound markers.
const CONTROL: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);

/// Writes an SVG with two stacked panels: (a) the speedup of on-demand over collective per row, with
/// a line at 1.0 (parity) and the balanced control's speedup as a marker; (b) the utilization of
/// both modes per row, with on-demand throughput as a fraction of the perfect-balance and of the
/// achievable bound as markers. Rows are on the x axis, labelled
/// `workload/devices/minibatch-per-device/dispatch` (see [`BenchRow::label`]), rotated when there
/// are many.
///
/// With no rows the SVG holds only the title and "no rows". Non-finite values are not drawn. Text is
/// emitted as SVG `<text>` (no fonts are embedded).
pub fn write_svg(path: &Path, rows: &[BenchRow]) -> Result<(), ReportError> {
    let mut svg = String::new();
    let rendered = render_svg(&mut svg, rows).map(|()| svg);
    write_rendered(path, rendered)
}

/// Writes a rendered SVG to `path`, or names `path` with why it could not be rendered or written.
pub(crate) fn write_rendered(
    path: &Path,
    rendered: Result<String, String>,
) -> Result<(), ReportError> {
    let svg = rendered.map_err(|message| ReportError::Plot {
        path: path.to_path_buf(),
        message,
    })?;
    write_file(path, svg)
}

/// A drawing area of a plot.
pub(crate) type Area<'b> = DrawingArea<SVGBackend<'b>, Shift>;
/// A panel of the plot: rows on x (one labelled tick per row), values on y.
type Panel<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<WithKeyPoints<RangedCoordi64>, RangedCoordf64>>;
/// What drawing on a plot can fail with.
pub(crate) type DrawError = DrawingAreaErrorKind<std::io::Error>;

/// Draws the plot of [`write_svg`] into `out`.
fn render_svg(out: &mut String, rows: &[BenchRow]) -> Result<(), String> {
    let width = u32::try_from(rows.len())
        .unwrap_or(u32::MAX)
        .saturating_mul(PIXELS_PER_ROW)
        .saturating_add(100)
        .clamp(SVG_SIZE.0, 20_000);
    let root = SVGBackend::with_string(out, (width, SVG_SIZE.1)).into_drawing_area();
    draw_plot(&root, rows).map_err(|e| e.to_string())
}

/// Draws the title and, for rows, panel (a) above panel (b) on `root`.
fn draw_plot(root: &Area<'_>, rows: &[BenchRow]) -> Result<(), DrawError> {
    root.fill(&WHITE)?;
    let body = root.titled(
        "odc: on-demand vs collective (workload/devices/minibatch per device/dispatch)",
        ("sans-serif", 26),
    )?;
    if rows.is_empty() {
        draw_no_rows(&body)?;
    } else {
        let axis = RowAxis::new(rows);
        let (top, bottom) = body.split_vertically(body.dim_in_pixel().1 / 2);
        draw_speedup(root, &top, rows, &axis)?;
        draw_utilization(root, &bottom, rows, &axis)?;
    }
    root.present()
}

/// "no rows" in the middle of `area`: a plot of nothing.
pub(crate) fn draw_no_rows(area: &Area<'_>) -> Result<(), DrawError> {
    let (w, h) = area.dim_in_pixel();
    area.draw(&Text::new(
        "no rows",
        (w as i32 / 2 - 40, h as i32 / 2),
        ("sans-serif", 30).into_font(),
    ))
}

/// The x axis shared by both panels: row i centred at x = i × [`SLOT`] (integer coordinates, so
/// the axis can carry one labelled tick per row).
struct RowAxis {
    labels: Vec<String>,
    /// Labels drawn downwards from their ticks (many rows) rather than centred under them.
    rotate: bool,
    /// Pixels below a panel for the labels.
    label_area: u32,
    /// The axis' length, [`SLOT`] per row.
    slots: i64,
}

impl RowAxis {
    fn new(rows: &[BenchRow]) -> RowAxis {
        let labels: Vec<String> = rows.iter().map(BenchRow::label).collect();
        let rotate = rows.len() > 6;
        let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0) as u32;
        let label_area = if rotate {
            (20 + 7 * longest).clamp(40, 200)
        } else {
            40
        };
        let slots = i64::try_from(rows.len()).unwrap_or(i64::MAX / SLOT) * SLOT;
        RowAxis {
            labels,
            rotate,
            label_area,
            slots,
        }
    }

    /// The x coordinate `offset` from row `i`'s centre.
    fn at(i: usize, offset: i64) -> i64 {
        i64::try_from(i).unwrap_or(i64::MAX / SLOT) * SLOT + offset
    }

    /// A panel on `area` with this axis, `caption` above and y from 0 to `y_top`, its grid and
    /// labels drawn (rotated labels on `root`: the mesh would centre them on the axis).
    fn panel<'a, 'b>(
        &self,
        root: &Area<'b>,
        area: &'a Area<'b>,
        caption: &str,
        y_top: f64,
        (y_desc, y_decimals): (&str, usize),
    ) -> Result<Panel<'a, 'b>, DrawError> {
        let x_range = (-SLOT / 2..self.slots - SLOT / 2)
            .with_key_points((0..self.slots).step_by(SLOT as usize).collect());
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(self.label_area)
            .y_label_area_size(60)
            .build_cartesian_2d(x_range, 0.0..y_top)?;
        let label_of = |x: &i64| {
            if self.rotate {
                return String::new();
            }
            usize::try_from(x / SLOT)
                .ok()
                .filter(|_| x % SLOT == 0)
                .and_then(|i| self.labels.get(i).cloned())
                .unwrap_or_default()
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&label_of)
            .x_label_style(("sans-serif", 14))
            .y_desc(y_desc)
            .y_label_formatter(&|y| format!("{y:.y_decimals$}"))
            .draw()?;
        if self.rotate {
            let style = TextStyle::from(("sans-serif", 14).into_font())
                .transform(FontTransform::Rotate90)
                .pos(Pos::new(HPos::Left, VPos::Center));
            for (i, label) in self.labels.iter().enumerate() {
                let (x, y) = chart.backend_coord(&(Self::at(i, 0), 0.0));
                root.draw(&Text::new(label.clone(), (x, y + 8), style.clone()))?;
            }
        }
        Ok(chart)
    }
}

/// The legend box in a panel's upper right corner.
fn draw_legend<'a, 'b: 'a>(chart: &mut Panel<'a, 'b>) -> Result<(), DrawError> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
}

/// Panel (a): each row's speedup as a bar (labelled when there are few rows), its control's as a
/// cross, and the parity line.
fn draw_speedup<'b>(
    root: &Area<'b>,
    area: &Area<'b>,
    rows: &[BenchRow],
    axis: &RowAxis,
) -> Result<(), DrawError> {
    let at = RowAxis::at;
    let max_speedup = rows
        .iter()
        .flat_map(|r| [Some(r.speedup), r.control_speedup])
        .flatten()
        .filter(|s| s.is_finite())
        .fold(1.0_f64, f64::max);
    let mut chart = axis.panel(
        root,
        area,
        "(a) speedup of on-demand over collective",
        max_speedup * 1.3,
        ("speedup (×)", 2),
    )?;
    let drawn = || {
        rows.iter()
            .enumerate()
            .filter(|(_, r)| r.speedup.is_finite() && r.speedup > 0.0)
    };
    chart
        .draw_series(drawn().map(|(i, r)| {
            Rectangle::new(
                [(at(i, -35), 0.0), (at(i, 35), r.speedup)],
                ONDEMAND.filled(),
            )
        }))?
        .label("speedup")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], ONDEMAND.filled()));
    if rows.len() <= 24 {
        chart.draw_series(drawn().map(|(i, r)| {
            Text::new(
                format!("{:.2}x", r.speedup),
                (at(i, -30), r.speedup + max_speedup * 0.06),
                ("sans-serif", 13).into_font(),
            )
        }))?;
    }
    chart
        .draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
            r.control_speedup
                .filter(|c| c.is_finite() && *c > 0.0)
                .map(|c| Cross::new((at(i, 0), c), 6, CONTROL.stroke_width(2)))
        }))?
        .label("balanced control (1.00 = fair)")
        .legend(|(x, y)| Cross::new((x + 7, y), 5, CONTROL.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            [(-SLOT / 2, 1.0), (axis.slots - SLOT / 2, 1.0)],
            REFERENCE.stroke_width(2),
        ))?
        .label("parity (1.0)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], REFERENCE.stroke_width(2)));
    draw_legend(&mut chart)
}

/// Panel (b): each row's utilization in both modes as bars, on-demand over the perfect-balance
/// and the achievable bound as markers.
fn draw_utilization<'b>(
    root: &Area<'b>,
    area: &Area<'b>,
    rows: &[BenchRow],
    axis: &RowAxis,
) -> Result<(), DrawError> {
    let at = RowAxis::at;
    let mut chart = axis.panel(
        root,
        area,
        "(b) utilization: busy device-seconds / (devices × wall)",
        UTILIZATION_TOP,
        ("utilization", 1),
    )?;
    let bars = |value: fn(&BenchRow) -> f64, from: i64, to: i64, color: RGBColor| {
        rows.iter()
            .enumerate()
            .filter(move |(_, r)| value(r).is_finite())
            .map(move |(i, r)| {
                let v = value(r).clamp(0.0, UTILIZATION_TOP);
                Rectangle::new([(at(i, from), 0.0), (at(i, to), v)], color.filled())
            })
    };
    chart
        .draw_series(bars(|r| r.collective_utilization, -38, -2, COLLECTIVE))?
        .label("collective")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], COLLECTIVE.filled()));
    chart
        .draw_series(bars(|r| r.ondemand_utilization, 2, 38, ONDEMAND))?
        .label("on-demand")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], ONDEMAND.filled()));
    // Each row's fraction of a bound at x offset 20, clamped to the axis.
    let fractions = |fraction: fn(&BenchRow) -> Option<f64>| {
        rows.iter().enumerate().filter_map(move |(i, r)| {
            fraction(r).map(|v| (at(i, 20), v.clamp(0.0, UTILIZATION_TOP)))
        })
    };
    chart
        .draw_series(
            fractions(BenchRow::ondemand_of_bound)
                .map(|p| Cross::new(p, 6, REFERENCE.stroke_width(2))),
        )?
        .label("on-demand / bound")
        .legend(|(x, y)| Cross::new((x + 7, y), 5, REFERENCE.stroke_width(2)));
    chart
        .draw_series(
            fractions(BenchRow::ondemand_of_achievable)
                .map(|p| Circle::new(p, 5, CONTROL.stroke_width(2))),
        )?
        .label("on-demand / achievable")
        .legend(|(x, y)| Circle::new((x + 7, y), 4, CONTROL.stroke_width(2)));
    draw_legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(workload: &str, devices: usize, speedup: f64) -> BenchRow {
        BenchRow {
            workload: workload.into(),
            devices,
            minibatch_per_device: 4,
            dispatch: "dynamic".into(),
            baseline: "fsdp".into(),
            collective_tokens_per_s: 100_000.0,
            ondemand_tokens_per_s: 100_000.0 * speedup,
            speedup,
            collective_utilization: 0.62,
            ondemand_utilization: 0.94,
            bound_tokens_per_s: 160_000.0,
            achievable_bound_tokens_per_s: 155_000.0,
            ondemand_over_achievable: 100_000.0 * speedup / 155_000.0,
            control_speedup: Some(1.02),
            emulation_warning: None,
        }
    }

    fn rows() -> Vec<BenchRow> {
        vec![
            row("longalign", 8, 1.523),
            row("rl", 8, 1.17),
            row("balanced", 8, 0.99),
        ]
    }

    fn temp_path(name: &str) -> PathBuf {
        crate::test_util::temp_path("odc-report", name)
    }

    #[test]
    fn json_round_trip() {
        let report = BenchReport { rows: rows() };
        let json = report.to_json();
        assert_eq!(BenchReport::from_json(&json).unwrap(), report);
        let path = temp_path("report.json");
        report.write_json(&path).unwrap();
        let back = BenchReport::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back, report);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn json_has_the_issue_schema() {
        let v: serde_json::Value =
            serde_json::from_str(&BenchReport { rows: rows() }.to_json()).unwrap();
        let obj = v.as_object().unwrap();
        assert_eq!(obj.keys().collect::<Vec<_>>(), ["rows"]);
        let row = v["rows"][0].as_object().unwrap();
        let mut keys: Vec<&str> = row.keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut expected = [
            "workload",
            "devices",
            "minibatch_per_device",
            "dispatch",
            "collective_tokens_per_s",
            "ondemand_tokens_per_s",
            "speedup",
            "collective_utilization",
            "ondemand_utilization",
            "bound_tokens_per_s",
            "achievable_bound_tokens_per_s",
            "ondemand_over_achievable",
            "control_speedup",
            "emulation_warning",
            "baseline",
        ];
        expected.sort_unstable();
        assert_eq!(keys, expected);
        assert!(row["devices"].is_u64());
        assert!(row["speedup"].is_f64());
        assert!(row["control_speedup"].is_f64());
        assert!(row["emulation_warning"].is_null());
        let mut none = rows();
        none[0].control_speedup = None;
        none[0].emulation_warning = Some("spans \"too\" short".into());
        let v: serde_json::Value =
            serde_json::from_str(&BenchReport { rows: none.clone() }.to_json()).unwrap();
        assert!(v["rows"][0]["control_speedup"].is_null());
        assert_eq!(v["rows"][0]["emulation_warning"], "spans \"too\" short");
        assert_eq!(
            BenchReport::from_json(&BenchReport { rows: none.clone() }.to_json())
                .unwrap()
                .rows,
            none
        );
    }

    #[test]
    fn from_json_rejects_bad_input() {
        assert!(matches!(
            BenchReport::from_json("{\"rows\":[{\"workload\":\"x\"}]}"),
            Err(ReportError::Json(_))
        ));
        let err = BenchReport::from_json("not json").unwrap_err();
        let text = crate::error_chain(&err);
        assert!(text.contains("line 1"), "{text}");
        assert_eq!(text.matches("line 1").count(), 1, "{text}");
    }

    #[test]
    fn write_json_error_names_the_path() {
        let path = temp_path("missing-dir").join("report.json");
        let err = BenchReport::default().write_json(&path).unwrap_err();
        assert!(matches!(&err, ReportError::Io { path: p, .. } if p == &path));
        assert!(err.to_string().contains("missing-dir"), "{err}");
    }

    #[test]
    fn table_contains_each_workload_and_formatted_speedup() {
        let table = format_table(&rows());
        for w in ["longalign", "rl", "balanced"] {
            assert!(table.contains(w), "{table}");
        }
        for s in ["1.52x", "1.17x", "0.99x"] {
            assert!(table.contains(s), "{table}");
        }
        assert!(table.contains("152,300"), "{table}");
        assert!(table.contains("0.952"), "od/bound: {table}");
        assert!(table.contains("0.983"), "od/achievable: {table}");
        assert!(table.contains("1.02x"), "control: {table}");
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + 3);
        assert!(lines[0].starts_with("workload"));
        assert!(lines[1].chars().all(|c| c == '-'));
    }

    #[test]
    fn table_right_aligns_numbers_in_fixed_columns() {
        let mut rs = rows();
        rs[1].devices = 16;
        rs[1].collective_tokens_per_s = 1_234_567.0;
        let table = format_table(&rs);
        let lines: Vec<&str> = table.lines().collect();
        // The devices column ends at the same offset on every line.
        let end_of = |line: &str, needle: &str| line.find(needle).map(|i| i + needle.len());
        let header_end = end_of(lines[0], "devices").unwrap();
        assert_eq!(end_of(lines[2], " 8").unwrap(), header_end);
        assert_eq!(end_of(lines[3], "16").unwrap(), header_end);
        assert!(table.contains("1,234,567"));
        // Speedups end where the header does.
        let speedup_end = end_of(lines[0], "speedup").unwrap();
        assert_eq!(end_of(lines[2], "1.52x").unwrap(), speedup_end);
    }

    #[test]
    fn table_handles_no_rows_and_non_finite_values() {
        let empty = format_table(&[]);
        assert_eq!(empty.lines().count(), 2);
        let mut r = row("weird", 4, f64::NAN);
        r.bound_tokens_per_s = 0.0;
        r.achievable_bound_tokens_per_s = f64::NAN;
        r.control_speedup = None;
        r.collective_tokens_per_s = f64::INFINITY;
        let table = format_table(&[r]);
        assert!(table.contains("n/a"), "{table}");
        assert!(!table.contains("NaN") && !table.contains("inf"), "{table}");
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(1_234_567.8), "1,234,568");
        assert_eq!(thousands(-12_345.0), "-12,345");
        assert_eq!(thousands(f64::NAN), "n/a");
    }

    #[test]
    fn svg_starts_with_svg_and_names_workloads() {
        let path = temp_path("bench.svg");
        write_svg(&path, &rows()).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        for w in ["longalign/8/4", "rl/8/4", "balanced/8/4", "1.52x"] {
            assert!(svg.contains(w), "missing {w}");
        }
        assert!(svg.contains("speedup") && svg.contains("utilization"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn svg_with_zero_one_and_many_rows_does_not_panic() {
        let path = temp_path("empty.svg");
        write_svg(&path, &[]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("no rows"));

        write_svg(&path, &rows()[..1]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("longalign"));

        let mut many: Vec<BenchRow> = (0..60)
            .map(|i| row(&format!("w{}", i % 5), 4 << (i % 3), 0.9 + i as f64 / 100.0))
            .collect();
        many[3].speedup = f64::NAN;
        many[4].ondemand_utilization = f64::INFINITY;
        many[5].bound_tokens_per_s = 0.0;
        write_svg(&path, &many).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("w4/"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn svg_error_names_the_path() {
        let path = temp_path("missing-dir").join("plot.svg");
        let err = write_svg(&path, &rows()).unwrap_err();
        assert!(matches!(&err, ReportError::Io { path: p, .. } if p == &path));
    }

    #[test]
    fn utilization_known_values() {
        assert_eq!(utilization(6.0, 4, 2.0), 0.75);
        assert_eq!(utilization(8.0, 4, 2.0), 1.0);
        assert_eq!(utilization(0.0, 4, 2.0), 0.0);
        // Tiny float excess is clamped; real excess is kept visible.
        assert_eq!(utilization(8.0 * (1.0 + 1e-12), 4, 2.0), 1.0);
        assert_eq!(utilization(-1e-15, 4, 2.0), 0.0);
        assert!((utilization(8.8, 4, 2.0) - 1.1).abs() < 1e-12);
    }

    #[test]
    fn utilization_degenerate_inputs_are_zero() {
        assert_eq!(utilization(6.0, 0, 2.0), 0.0);
        assert_eq!(utilization(6.0, 4, 0.0), 0.0);
        assert_eq!(utilization(6.0, 4, -1.0), 0.0);
        assert_eq!(utilization(f64::NAN, 4, 2.0), 0.0);
        assert_eq!(utilization(6.0, 4, f64::NAN), 0.0);
        assert_eq!(utilization(f64::INFINITY, 4, 2.0), 0.0);
        assert_eq!(utilization(1.0, 4, 1e-320), 0.0);
    }

    #[test]
    fn bound_known_values() {
        assert_eq!(bound_tokens_per_s(100_000, 40.0, 8), 20_000.0);
        assert_eq!(bound_tokens_per_s(1_000, 10.0, 1), 100.0);
        // Perfect balance: 4 devices each busy 2.5 s on 10 s of total work.
        assert_eq!(bound_tokens_per_s(50_000, 10.0, 4), 20_000.0);
        assert_eq!(bound_tokens_per_s(0, 10.0, 4), 0.0);
    }

    #[test]
    fn bound_degenerate_inputs_are_zero() {
        assert_eq!(bound_tokens_per_s(100, 0.0, 8), 0.0);
        assert_eq!(bound_tokens_per_s(100, -1.0, 8), 0.0);
        assert_eq!(bound_tokens_per_s(100, f64::NAN, 8), 0.0);
        assert_eq!(bound_tokens_per_s(100, f64::INFINITY, 8), 0.0);
        assert_eq!(bound_tokens_per_s(100, 10.0, 0), 0.0);
        assert_eq!(bound_tokens_per_s(u64::MAX, 1e-320, 8), 0.0);
    }

    #[test]
    fn ondemand_of_bound_ratio() {
        let r = row("x", 8, 1.5);
        assert!((r.ondemand_of_bound().unwrap() - 150_000.0 / 160_000.0).abs() < 1e-12);
        let mut r0 = r.clone();
        r0.bound_tokens_per_s = 0.0;
        assert_eq!(r0.ondemand_of_bound(), None);
        assert_eq!(r.label(), "x/8/4/dynamic");
    }
}
