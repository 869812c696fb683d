//! Progress of long `range` and `chunked` calls on stderr: items done of total, the current
//! step, out-of-memories caught and items per second. Drawn with `indicatif` (feature
//! `progress`); without the feature a call that asks for progress draws nothing.

/// Whether a `range` or `chunked` call shows its progress on stderr.
///
/// `true` converts to [`Progress::Terminal`], `false` to [`Progress::Off`].
///
/// ```
/// let mut covered = 0;
/// toma::Range::new(0, 1000, 64).progress(true).run(|start, end| {
///     covered += end - start;
///     Ok::<(), String>(())
/// })?;
/// assert_eq!(covered, 1000);
/// # Ok::<(), String>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Progress {
    /// No progress (the default).
    #[default]
    Off,
    /// A bar on stderr when stderr is a terminal; nothing otherwise (logs and pipes stay clean).
    Terminal,
    /// On stderr whatever it is: a redrawn bar on a terminal, else one line a second.
    Always,
}

impl From<bool> for Progress {
    fn from(on: bool) -> Self {
        if on {
            Progress::Terminal
        } else {
            Progress::Off
        }
    }
}

/// The bar of one call, when it draws one (never, without feature `progress`).
#[derive(Debug)]
#[cfg_attr(not(feature = "progress"), allow(dead_code))]
pub(crate) struct Bar {
    #[cfg(feature = "progress")]
    bar: indicatif::ProgressBar,
    start: usize,
    out_of_memory: u32,
}

impl Bar {
    /// A bar over `[start, end)`, or `None` when `progress` draws nothing here.
    pub(crate) fn start(progress: Progress, start: usize, end: usize, label: &'static str) -> Option<Box<Bar>> {
        if progress == Progress::Off || start >= end {
            return None;
        }
        Self::draw(progress, start, end, label)
    }

    #[cfg(feature = "progress")]
    fn draw(progress: Progress, start: usize, end: usize, label: &'static str) -> Option<Box<Bar>> {
        use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
        use std::io::IsTerminal;
        let terminal = std::io::stderr().is_terminal();
        let target = match (progress, terminal) {
            (_, true) => ProgressDrawTarget::stderr(),
            (Progress::Always, false) => ProgressDrawTarget::term_like_with_hz(Box::new(Lines), 1),
            _ => return None,
        };
        let style = ProgressStyle::with_template(
            "{prefix} [{bar:32}] {pos}/{len} items | {msg} | {rate} | {elapsed_precise} (eta {eta})",
        )
        .map(|s| {
            s.progress_chars("=> ").with_key("rate", |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:.0} items/s", state.per_sec());
            })
        })
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        let bar = ProgressBar::with_draw_target(Some((end - start) as u64), target).with_style(style);
        bar.set_prefix(label);
        Some(Box::new(Bar { bar, start, out_of_memory: 0 }))
    }

    #[cfg(not(feature = "progress"))]
    fn draw(_: Progress, _: usize, _: usize, _: &'static str) -> Option<Box<Bar>> {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::debug!("toma: progress was asked for, but toma was built without feature `progress`")
        });
        None
    }

    /// The call covered `[start, position)` and goes on with `step`.
    pub(crate) fn advance(&mut self, position: usize, step: usize) {
        self.show(position, step);
    }

    /// An attempt ran out of memory; the call goes on with `step`.
    pub(crate) fn out_of_memory(&mut self, position: usize, step: usize) {
        self.out_of_memory += 1;
        self.show(position, step);
    }

    #[cfg_attr(not(feature = "progress"), allow(unused_variables))]
    fn show(&mut self, position: usize, step: usize) {
        #[cfg(feature = "progress")]
        {
            self.bar.set_position((position - self.start) as u64);
            self.bar.set_message(format!("step {step} | {} out of memory caught", self.out_of_memory));
        }
    }

    /// The call ended: the bar stays with its last figures.
    pub(crate) fn finish(&mut self) {
        #[cfg(feature = "progress")]
        self.bar.abandon();
    }
}

/// A draw target for stderr that is not a terminal: each redraw is one plain line.
#[cfg(feature = "progress")]
#[derive(Debug, Default)]
struct Lines;

#[cfg(feature = "progress")]
impl indicatif::TermLike for Lines {
    fn width(&self) -> u16 {
        120
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, line: &str) -> std::io::Result<()> {
        use std::io::Write;
        if line.trim().is_empty() {
            return Ok(());
        }
        writeln!(std::io::stderr().lock(), "{line}")
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.write_line(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        use std::io::Write;
        std::io::stderr().flush()
    }
}
