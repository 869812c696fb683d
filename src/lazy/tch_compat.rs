//! Settings tch keeps private, read from its layers' `Debug` text: the one place that depends
//! on how tch prints them (tch 0.24: `Conv { ws: .., config: ConvConfigND { stride: [2, 1], .. } }`).
//!
//! tch has no accessors for a convolution's stride or a norm's epsilon, and the lazy adapters
//! need them. If a tch release prints these differently, a setting that cannot be read is a
//! [`LazyError::Unsupported`] naming the layer and the tch version this was written for, never
//! a wrong value; and the tests below, which build each layer with non-default settings and read
//! them back, fail.

use tch::nn;

use super::error::LazyError;

/// The tch line these readers were written against.
const TCH: &str = "0.24";

/// A convolution's settings.
pub(crate) struct ConvSettings {
    pub(crate) stride: Vec<i64>,
    pub(crate) padding: Vec<i64>,
    pub(crate) dilation: Vec<i64>,
    pub(crate) groups: i64,
    /// `Zeros`, `Reflect`, `Replicate` or `Circular`, as tch prints its `PaddingMode`.
    pub(crate) padding_mode: String,
}

/// A convolution's settings; `what` names the layer (`nn::Conv2D`) in errors.
pub(crate) fn conv<ND: std::fmt::Debug>(layer: &nn::Conv<ND>, what: &str) -> Result<ConvSettings, LazyError> {
    let text = debug_text(layer, &[]);
    let config = config_of(what, &text)?;
    let list = |name: &str| field(config, name).and_then(parse_list).ok_or_else(|| unreadable(what, name));
    Ok(ConvSettings {
        stride: list("stride")?,
        padding: list("padding")?,
        dilation: list("dilation")?,
        groups: parsed(what, config, "groups")?,
        padding_mode: field(config, "padding_mode").unwrap_or("Zeros").to_owned(),
    })
}

/// A transposed convolution's settings.
pub(crate) struct ConvTransposeSettings {
    pub(crate) stride: Vec<i64>,
    pub(crate) padding: Vec<i64>,
    pub(crate) output_padding: Vec<i64>,
    pub(crate) dilation: Vec<i64>,
    pub(crate) groups: i64,
}

/// A transposed convolution's settings; `what` names the layer in errors.
pub(crate) fn conv_transpose<ND: std::fmt::Debug>(
    layer: &nn::ConvTransposeND<ND>,
    what: &str,
) -> Result<ConvTransposeSettings, LazyError> {
    let text = debug_text(layer, &[]);
    let config = config_of(what, &text)?;
    let list = |name: &str| field(config, name).and_then(parse_list).ok_or_else(|| unreadable(what, name));
    Ok(ConvTransposeSettings {
        stride: list("stride")?,
        padding: list("padding")?,
        output_padding: list("output_padding")?,
        dilation: list("dilation")?,
        groups: parsed(what, config, "groups")?,
    })
}

/// A layer norm's epsilon.
pub(crate) fn layer_norm_eps(layer: &nn::LayerNorm) -> Result<f64, LazyError> {
    let text = debug_text(layer, &["eps"]);
    parsed("nn::LayerNorm", config_of("nn::LayerNorm", &text)?, "eps")
}

/// A group norm's `eps` (tch keeps its config private).
pub(crate) fn group_norm_eps(layer: &nn::GroupNorm) -> Result<f64, LazyError> {
    let text = debug_text(layer, &["eps"]);
    parsed("nn::GroupNorm", config_of("nn::GroupNorm", &text)?, "eps")
}

/// An embedding's `(padding_idx, scale_grad_by_freq, sparse)`.
pub(crate) fn embedding(layer: &nn::Embedding) -> Result<(i64, bool, bool), LazyError> {
    let text = debug_text(layer, &["padding_idx", "scale_grad_by_freq", "sparse"]);
    let config = config_of("nn::Embedding", &text)?;
    Ok((
        parsed("nn::Embedding", config, "padding_idx")?,
        parsed("nn::Embedding", config, "scale_grad_by_freq")?,
        parsed("nn::Embedding", config, "sparse")?,
    ))
}

/// A batch norm's `(eps, momentum)`.
pub(crate) fn batch_norm(layer: &nn::BatchNorm) -> Result<(f64, f64), LazyError> {
    let text = debug_text(layer, &["eps", "momentum"]);
    let config = config_of("nn::BatchNorm", &text)?;
    Ok((parsed("nn::BatchNorm", config, "eps")?, parsed("nn::BatchNorm", config, "momentum")?))
}

/// The layer's `Debug` text up to the end of its `config`, or as soon as each of `wanted` has
/// its whole value there: a layer is read each time a step records it, and formatting the rest
/// (a norm's initialisers, its weights printed as tensors, some read back from the tensor)
/// would cost more than recording the layer.
fn debug_text(layer: &dyn std::fmt::Debug, wanted: &[&str]) -> String {
    use std::fmt::Write;
    // Room for a layer's text up to its config: one allocation, not one per doubling.
    let mut text = UpToConfig { text: String::with_capacity(256), wanted, ..UpToConfig::default() };
    // An error here is the stop below: the text holds what is wanted.
    let _ = write!(text, "{layer:?}");
    text.text
}

/// A `fmt::Write` that keeps what is written and stops the formatting (with an error) once
/// the `config:` field's value is complete, or each of `wanted` in it is.
#[derive(Default)]
struct UpToConfig<'a> {
    text: String,
    wanted: &'a [&'a str],
    /// Where `config:` starts, once written.
    config: Option<usize>,
    /// How far the brackets after it were followed, and how deep they are.
    followed: usize,
    depth: i32,
    /// Where the config's current field starts, and which of `wanted` are whole (bit i).
    field: usize,
    found: u64,
}

impl UpToConfig<'_> {
    /// Notes the config's field that ends at `end` if it is one of `wanted`: whether all are.
    fn field_ends(&mut self, end: usize) -> bool {
        let field = &self.text[self.field..end];
        let name = field.split_once(':').map_or("", |(name, _)| name.trim());
        debug_assert!(self.wanted.len() <= 64, "a bit for each wanted setting");
        if let Some(i) = self.wanted.iter().position(|w| *w == name) {
            self.found |= 1 << i;
        }
        !self.wanted.is_empty() && self.found.count_ones() as usize == self.wanted.len()
    }
}

impl std::fmt::Write for UpToConfig<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.text.push_str(s);
        if self.config.is_none() {
            // `config:` may come in pieces, but it is whole once its `:` is written: look
            // again from just before this piece, only then.
            let mut from = self.followed.saturating_sub("config:".len());
            self.followed = self.text.len();
            if !s.contains(':') {
                return Ok(());
            }
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            let Some(at) = self.text[from..].find("config:").map(|at| from + at) else { return Ok(()) };
            self.config = Some(at);
            self.followed = at;
        }
        // One pass over what came since: brackets, and the config's fields as each ends (at a
        // `,` or its closing bracket, at the config's own depth).
        let mut i = self.followed;
        while i < self.text.len() {
            let ch = self.text.as_bytes()[i];
            match ch {
                b'[' | b'(' | b'{' => {
                    self.depth += 1;
                    if self.depth == 1 {
                        self.field = i + 1;
                    }
                }
                b']' | b')' | b'}' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        self.text.truncate(i + 1);
                        return Err(std::fmt::Error);
                    }
                }
                b',' if self.depth == 1 => {
                    if self.field_ends(i) {
                        return Err(std::fmt::Error);
                    }
                    self.field = i + 1;
                }
                _ => {}
            }
            i += 1;
        }
        self.followed = self.text.len();
        Ok(())
    }
}

fn unreadable(layer: &str, name: &str) -> LazyError {
    LazyError::Unsupported {
        op: layer.into(),
        reason: format!("cannot read `{name}` from the layer's Debug text, as tch {TCH} prints it"),
    }
}

/// The text from the layer's `config:` on.
fn config_of<'a>(layer: &str, text: &'a str) -> Result<&'a str, LazyError> {
    text.find("config:").map(|at| &text[at..]).ok_or_else(|| unreadable(layer, "config"))
}

fn parsed<T: std::str::FromStr>(layer: &str, config: &str, name: &str) -> Result<T, LazyError> {
    field(config, name).and_then(|v| v.parse().ok()).ok_or_else(|| unreadable(layer, name))
}

/// The value of `name: value` in a `Debug` text, bracket-aware (`stride: [1, 1]`).
fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let start = text.match_indices(name).find(|&(at, _)| text[at + name.len()..].starts_with(": "))?.0;
    let rest = &text[start + name.len() + 2..];
    let mut depth = 0i32;
    for (i, ch) in rest.char_indices() {
        match ch {
            '[' | '(' | '{' => depth += 1,
            ']' | ')' | '}' if depth == 0 => return Some(rest[..i].trim()),
            ']' | ')' | '}' => depth -= 1,
            ',' if depth == 0 => return Some(rest[..i].trim()),
            _ => {}
        }
    }
    Some(rest.trim())
}

fn parse_list(text: &str) -> Option<Vec<i64>> {
    let inner = text.strip_prefix('[')?.strip_suffix(']')?;
    inner.split(',').map(|v| v.trim().parse().ok()).collect()
}

/// Whether autograd records now (libtorch's thread-local grad mode). Every recorded op that
/// requires a gradient asks: the shim reads it; without the shim it is set and set back
/// (two calls through tch's C wrapper, about 40 ns).
pub(crate) fn grad_enabled() -> bool {
    crate::memory::grad_enabled().unwrap_or_else(|| {
        // SAFETY: sets the calling thread's grad mode and returns the previous one; it is set
        // back at once. libtorch's wrapper catches any exception (it returns -1 then: taken as on).
        unsafe {
            let previous = torch_sys::at_grad_set_enabled(1);
            torch_sys::at_grad_set_enabled(previous);
            previous != 0
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn fields_are_read_bracket_aware() {
        let text = "Conv { ws: Tensor[[8, 3, 3, 3], Float], config: ConvConfigND { stride: [2, 1], padding: [1, 1], \
                    groups: 1, padding_mode: Zeros } }";
        assert_eq!(field(text, "stride").and_then(parse_list), Some(vec![2, 1]));
        assert_eq!(field(text, "groups"), Some("1"));
        assert_eq!(field(text, "padding_mode"), Some("Zeros"));
        assert_eq!(field(text, "missing"), None);
    }

    /// The text stops where the config ends, however the formatter splits its writes, and is
    /// whole where there is no config.
    #[test]
    fn the_text_stops_after_the_config() {
        struct Pieces(&'static [&'static str]);
        impl std::fmt::Debug for Pieces {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.iter().try_for_each(|p| f.write_str(p))
            }
        }
        let split =
            Pieces(&["LayerNorm { con", "fig: C { eps: 1e-5, s", "hape: [2, 3] }", ", ws: Tensor[[6], Float] }"]);
        assert_eq!(debug_text(&split, &[]), "LayerNorm { config: C { eps: 1e-5, shape: [2, 3] }");
        assert_eq!(debug_text(&split, &["eps"]), "LayerNorm { config: C { eps: 1e-5, s");
        assert_eq!(debug_text(&split, &["shape", "eps"]), "LayerNorm { config: C { eps: 1e-5, shape: [2, 3] }");
        let none = Pieces(&["Linear { ws: ", "Tensor[[6], Float] }"]);
        assert_eq!(debug_text(&none, &[]), "Linear { ws: Tensor[[6], Float] }");
        let vs = nn::VarStore::new(Device::Cpu);
        let ln = nn::layer_norm(vs.root() / "ln", vec![6], Default::default());
        let text = debug_text(&ln, &["eps"]);
        assert!(text.contains("eps: ") && !text.contains("Tensor") && !text.contains("init"), "{text}");
    }

    /// Every setting, non-default, read back from real tch layers: this fails when tch prints
    /// its layers differently.
    #[test]
    fn the_settings_of_real_tch_layers_read_back() {
        let vs = nn::VarStore::new(Device::Cpu);
        let r = vs.root();
        let layer = nn::conv2d(
            &r / "c",
            4,
            8,
            3,
            nn::ConvConfig { stride: 2, padding: 3, dilation: 2, groups: 2, ..Default::default() },
        );
        let c = conv(&layer, "nn::Conv2D").expect("tch's Conv2D Debug text");
        assert_eq!((c.stride, c.padding, c.dilation, c.groups), (vec![2, 2], vec![3, 3], vec![2, 2], 2));
        assert_eq!(c.padding_mode, "Zeros");
        let reflect = nn::conv2d(
            &r / "r",
            1,
            1,
            3,
            nn::ConvConfig { padding_mode: nn::PaddingMode::Reflect, ..Default::default() },
        );
        assert_eq!(conv(&reflect, "nn::Conv2D").unwrap().padding_mode, "Reflect");
        let one = nn::conv1d(
            &r / "c1",
            4,
            8,
            5,
            nn::ConvConfig { stride: 3, padding: 2, dilation: 2, groups: 4, ..Default::default() },
        );
        let c = conv(&one, "nn::Conv1D").expect("tch's Conv1D Debug text");
        assert_eq!((c.stride, c.padding, c.dilation, c.groups), (vec![3], vec![2], vec![2], 4));

        let config = nn::ConvTransposeConfig {
            stride: 3,
            padding: 2,
            output_padding: 1,
            dilation: 2,
            groups: 2,
            ..Default::default()
        };
        let t = nn::conv_transpose2d(&r / "t", 4, 6, 3, config);
        let c = conv_transpose(&t, "nn::ConvTranspose2D").expect("tch's ConvTranspose2D Debug text");
        assert_eq!(
            (c.stride, c.padding, c.output_padding, c.dilation, c.groups),
            (vec![3, 3], vec![2, 2], vec![1, 1], vec![2, 2], 2)
        );

        let ln = nn::layer_norm(&r / "ln", vec![6], nn::LayerNormConfig { eps: 1e-3, ..Default::default() });
        assert_eq!(layer_norm_eps(&ln).unwrap(), 1e-3);

        let config = nn::EmbeddingConfig { padding_idx: 4, scale_grad_by_freq: true, ..Default::default() };
        let emb = nn::embedding(&r / "e", 10, 3, config);
        assert_eq!(embedding(&emb).unwrap(), (4, true, false));

        let bn =
            nn::batch_norm2d(&r / "bn", 3, nn::BatchNormConfig { eps: 1e-3, momentum: 0.25, ..Default::default() });
        assert_eq!(batch_norm(&bn).unwrap(), (1e-3, 0.25));
    }
}
