//! A small SVG chart writer for toma's pictures ([`Plan::to_svg`](crate::lazy::Plan::to_svg),
//! [`Report::to_svg`](crate::Report::to_svg)): self-contained files with inline styles and no
//! scripts, so that browsers and GitHub's image view render them alike.
//!
//! Every drawn series is a `<g>` with a `data-series` attribute naming it, so tests (and
//! anyone post-processing the pictures) can find them.

use std::fmt::Write;

/// Width and height of every picture, in pixels.
const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 480.0;
/// Plot area margins: left (byte labels), right, top (title, legend), bottom (axis label).
const LEFT: f64 = 84.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 64.0;
const BOTTOM: f64 = 56.0;
const FONT: &str = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\"";

/// Escapes text for SVG content and attributes.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => {}
            c => out.push(c),
        }
    }
    out
}

/// Bytes as a short label: `512 B`, `1.5 KiB`, `20 MiB`, `3.2 GiB` (plans print them so too).
pub(crate) fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 || v >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// What the y axis counts.
#[derive(Clone, Copy)]
pub(crate) enum Unit {
    Bytes,
    Count,
}

/// A chart under construction: x from 0 to `x_max`, y from 0 to `y_max`.
pub(crate) struct Chart {
    x_max: f64,
    y_max: f64,
    /// Grid step, and the divisor and unit name of the y labels.
    y_step: f64,
    scale: (f64, &'static str),
    body: String,
    legend: Vec<(String, String, bool)>,
    title: String,
    x_label: String,
}

// Plans draw bands, steps and markers: without `tch` there are none.
#[cfg_attr(not(feature = "tch"), allow(dead_code))]
impl Chart {
    pub(crate) fn new(title: &str, x_label: &str, x_max: f64, y_max: f64, unit: Unit) -> Chart {
        let (y_max, y_step, scale) = axis(y_max.max(1.0), unit);
        Chart {
            x_max: x_max.max(1.0),
            y_max,
            y_step,
            scale,
            body: String::new(),
            legend: Vec::new(),
            title: title.to_owned(),
            x_label: x_label.to_owned(),
        }
    }

    fn x(&self, v: f64) -> f64 {
        LEFT + (WIDTH - LEFT - RIGHT) * (v / self.x_max).clamp(0.0, 1.0)
    }

    fn y(&self, v: f64) -> f64 {
        TOP + (HEIGHT - TOP - BOTTOM) * (1.0 - (v / self.y_max).clamp(0.0, 1.0))
    }

    /// A shaded band over `[x0, x1]` (a phase), labelled at its top.
    pub(crate) fn band(&mut self, name: &str, x0: f64, x1: f64, color: &str, label: &str) {
        let (a, b) = (self.x(x0), self.x(x1));
        let _ = write!(
            self.body,
            "<g data-series=\"{}\"><rect x=\"{a:.1}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\" \
             fill-opacity=\"0.12\"/><text x=\"{:.1}\" y=\"{:.1}\" {FONT} font-size=\"12\" fill=\"#555\" \
             text-anchor=\"middle\">{}</text></g>",
            escape(name),
            (b - a).max(0.5),
            HEIGHT - TOP - BOTTOM,
            (a + b) / 2.0,
            TOP + 14.0,
            escape(label)
        );
    }

    /// A step line through `points` (each holds its value until the next x).
    pub(crate) fn steps(&mut self, name: &str, label: &str, points: &[(f64, f64)], color: &str, dashed: bool) {
        let mut path = String::new();
        for (k, &(x, y)) in points.iter().enumerate() {
            let (px, py) = (self.x(x), self.y(y));
            if k == 0 {
                let _ = write!(path, "M{px:.1},{py:.1}");
            } else {
                let _ = write!(path, " H{px:.1} V{py:.1}");
            }
        }
        if let Some(&(x, _)) = points.last() {
            let _ = write!(path, " H{:.1}", self.x(x + 1.0));
        }
        let dash = if dashed { " stroke-dasharray=\"6 4\"" } else { "" };
        let _ = write!(
            self.body,
            "<g data-series=\"{}\"><path d=\"{path}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash}/></g>",
            escape(name)
        );
        self.legend.push((label.to_owned(), color.to_owned(), dashed));
    }

    /// A horizontal line at `y` across the plot, labelled at its right end.
    pub(crate) fn hline(&mut self, name: &str, label: &str, y: f64, color: &str) {
        let py = self.y(y);
        let _ = write!(
            self.body,
            "<g data-series=\"{}\"><line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{py:.1}\" y2=\"{py:.1}\" stroke=\"{color}\" \
             stroke-width=\"1.5\" stroke-dasharray=\"2 3\"/><text x=\"{:.1}\" y=\"{:.1}\" {FONT} font-size=\"12\" \
             fill=\"{color}\" text-anchor=\"end\">{}</text></g>",
            escape(name),
            WIDTH - RIGHT,
            WIDTH - RIGHT - 4.0,
            py - 5.0,
            escape(label)
        );
    }

    /// A point marked with a dot and a label.
    pub(crate) fn marker(&mut self, name: &str, x: f64, y: f64, label: &str, color: &str) {
        let (px, py) = (self.x(x), self.y(y));
        let anchor = if px > WIDTH * 0.7 { "end" } else { "start" };
        let dx = if anchor == "end" { -8.0 } else { 8.0 };
        let _ = write!(
            self.body,
            "<g data-series=\"{}\"><circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"5\" fill=\"{color}\"/><text x=\"{:.1}\" \
             y=\"{:.1}\" {FONT} font-size=\"13\" font-weight=\"bold\" fill=\"#222\" text-anchor=\"{anchor}\">{}</text></g>",
            escape(name),
            px + dx,
            (py - 8.0).max(TOP + 12.0),
            escape(label)
        );
    }

    /// Bars, one per x (at `x`, `0.8` wide), each with its own color and an optional label
    /// above it.
    pub(crate) fn bars(&mut self, name: &str, bars: &[(f64, f64, &str, Option<String>)]) {
        let w = (self.x(0.8) - self.x(0.0)).max(1.0);
        let _ = write!(self.body, "<g data-series=\"{}\">", escape(name));
        for (x, y, color, label) in bars {
            let (px, py) = (self.x(*x + 0.1), self.y(*y));
            let _ = write!(
                self.body,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"{:.1}\" fill=\"{color}\"/>",
                px,
                py.min(self.y(0.0) - 3.0),
                (self.y(0.0) - py).max(3.0)
            );
            if let Some(label) = label {
                let _ = write!(
                    self.body,
                    "<text x=\"{:.1}\" y=\"{:.1}\" {FONT} font-size=\"11\" fill=\"#333\" text-anchor=\"middle\">{}</text>",
                    px + w / 2.0,
                    py - 4.0,
                    escape(label)
                );
            }
        }
        self.body.push_str("</g>");
    }

    /// Adds a legend entry without a series (for bars' colors).
    pub(crate) fn legend(&mut self, label: &str, color: &str) {
        self.legend.push((label.to_owned(), color.to_owned(), false));
    }

    fn tick_label(&self, v: f64) -> String {
        let (divisor, name) = self.scale;
        let x = v / divisor;
        let number = if (x - x.round()).abs() < 1e-9 { format!("{x:.0}") } else { format!("{x:.1}") };
        if name.is_empty() {
            number
        } else {
            format!("{number} {name}")
        }
    }

    /// The finished document.
    pub(crate) fn finish(self) -> String {
        let mut out = String::with_capacity(self.body.len() + 4096);
        let _ = write!(
            out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} \
             {HEIGHT}\" role=\"img\"><title>{}</title><rect width=\"{WIDTH}\" height=\"{HEIGHT}\" fill=\"white\"/>",
            escape(&self.title)
        );
        // A long title gets a smaller font rather than running off the picture.
        let size = (16.0 * 95.0 / self.title.chars().count().max(1) as f64).clamp(10.0, 16.0);
        let _ = write!(
            out,
            "<text x=\"{LEFT}\" y=\"24\" {FONT} font-size=\"{size:.1}\" font-weight=\"bold\" fill=\"#111\">{}</text>",
            escape(&self.title)
        );
        // Grid and y labels at round values.
        let ticks = (self.y_max / self.y_step).round() as usize;
        for k in 0..=ticks {
            let v = self.y_step * k as f64;
            let py = self.y(v);
            let _ = write!(
                out,
                "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{py:.1}\" y2=\"{py:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" \
                 y=\"{:.1}\" {FONT} font-size=\"12\" fill=\"#444\" text-anchor=\"end\">{}</text>",
                WIDTH - RIGHT,
                LEFT - 6.0,
                py + 4.0,
                self.tick_label(v)
            );
        }
        let bottom = HEIGHT - BOTTOM;
        let _ = write!(
            out,
            "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{bottom}\" y2=\"{bottom}\" stroke=\"#444\"/><text x=\"{:.1}\" \
             y=\"{:.1}\" {FONT} font-size=\"13\" fill=\"#333\" text-anchor=\"middle\">{}</text>",
            WIDTH - RIGHT,
            (LEFT + WIDTH - RIGHT) / 2.0,
            HEIGHT - 16.0,
            escape(&self.x_label)
        );
        // x labels at round steps.
        let (_, x_step, _) = axis(self.x_max, Unit::Count);
        let mut v = 0.0;
        while v <= self.x_max {
            let _ = write!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" {FONT} font-size=\"11\" fill=\"#555\" text-anchor=\"middle\">{v:.0}</text>",
                self.x(v),
                bottom + 15.0
            );
            v += x_step;
        }
        out.push_str(&self.body);
        // Legend, left to right under the title.
        let mut x = LEFT;
        for (label, color, dashed) in &self.legend {
            let dash = if *dashed { " stroke-dasharray=\"6 4\"" } else { "" };
            let _ = write!(
                out,
                "<line x1=\"{x:.1}\" x2=\"{:.1}\" y1=\"44\" y2=\"44\" stroke=\"{color}\" stroke-width=\"3\"{dash}/>\
                 <text x=\"{:.1}\" y=\"48\" {FONT} font-size=\"12\" fill=\"#333\">{}</text>",
                x + 22.0,
                x + 27.0,
                escape(label)
            );
            x += 36.0 + 7.0 * label.chars().count() as f64;
        }
        out.push_str("</svg>\n");
        out
    }
}

/// The y axis for values up to `v`: its top, its grid step (1, 2, 2.5 or 5 times a power of
/// ten in the label unit, four to eight steps), and the label unit (bytes: the binary unit
/// that keeps the top under 1024).
fn axis(v: f64, unit: Unit) -> (f64, f64, (f64, &'static str)) {
    let scale = match unit {
        Unit::Count => (1.0, ""),
        Unit::Bytes => {
            const NAMES: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
            let mut k = 0;
            while v / 1024f64.powi(k as i32) >= 1024.0 && k + 1 < NAMES.len() {
                k += 1;
            }
            (1024f64.powi(k as i32), NAMES[k])
        }
    };
    let x = v / scale.0;
    let rough = x / 5.0;
    let p = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * p).find(|&s| s >= rough).unwrap_or(10.0 * p);
    let step = if matches!(unit, Unit::Count) { step.max(1.0) } else { step };
    let top = (x / step).ceil().max(1.0) * step;
    (top * scale.0, step * scale.0, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_and_bytes_read_well() {
        assert_eq!(escape("a<b & \"c\"'"), "a&lt;b &amp; &quot;c&quot;&#39;");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes(20.0 * 1024.0 * 1024.0), "20 MiB");
        let mib = 1024.0 * 1024.0;
        let (top, step, (divisor, name)) = axis(1.5 * mib, Unit::Bytes);
        assert_eq!((top / mib, step / mib, divisor, name), (1.5, 0.5, mib, "MiB"));
        assert_eq!(axis(64.0, Unit::Count).0, 80.0);
        assert_eq!(axis(3.0, Unit::Count).1, 1.0, "counts step by whole numbers");
    }

    #[test]
    fn a_chart_names_its_series_and_balances_its_tags() {
        let mut c = Chart::new("t <1>", "step", 10.0, 100.0, Unit::Count);
        c.band("backward", 5.0, 10.0, "#c33", "backward");
        c.steps("live", "live bytes", &[(0.0, 1.0), (1.0, 50.0), (2.0, 20.0)], "#36c", false);
        c.hline("budget", "budget", 80.0, "#c00");
        c.marker("peak", 1.0, 50.0, "peak", "#c00");
        c.bars("attempts", &[(0.0, 10.0, "#3a3", Some("10".into())), (1.0, 5.0, "#c33", None)]);
        let svg = c.finish();
        for series in ["backward", "live", "budget", "peak", "attempts"] {
            assert!(svg.contains(&format!("data-series=\"{series}\"")), "{series}");
        }
        assert!(svg.contains("t &lt;1&gt;"));
        for tag in ["g", "text", "svg"] {
            assert_eq!(
                svg.matches(&format!("<{tag} ")).count() + svg.matches(&format!("<{tag}>")).count(),
                svg.matches(&format!("</{tag}>")).count(),
                "<{tag}> balanced"
            );
        }
    }
}
