//! Autocast as data: which recorded ops libtorch 2.11's autocast casts, per device type, and the
//! casts a node recorded in a region gets (see [`crate::autocast`]).
//!
//! The lists follow libtorch's `autocast_mode.h` (`AT_FORALL_LOWER_PRECISION_FP`,
//! `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_PROMOTE`, registered for CUDA)
//! and `autocast_mode.cpp` (its own CPU lists), by the names of toma's ops. An op not listed
//! runs in the kinds that reach it, as under libtorch's autocast. The casts are recorded as
//! `autocast` nodes (a `to_kind`), so that the graph computes what eager autocast computes when
//! it runs outside the region, and the plan counts every cast copy autograd keeps.

use tch::{Device, Kind};

use crate::autocast::DeviceType;
use crate::lazy::graph::Node;

/// How autocast treats an op's floating inputs (`f64` ones are left alone, as libtorch does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Cast to the region's kind (`BFloat16` or `Half`): products, convolutions, attention.
    Lower,
    /// Cast to `Float`: ops whose range or accuracy 16 bits would hurt (losses, norms, `exp`..).
    /// libtorch's `fp32_set_opt_dtype` ops (`softmax`, `sum`, ..: computed in `Float` from a
    /// lower input) are recorded so too.
    Float,
    /// Cast to the widest floating kind among the inputs (`cat` of `BFloat16` and `Float`).
    Promote,
}

/// Products, convolutions and attention: lower precision on both device types.
const LOWER: &[&str] = &[
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "matmul",
    "bmm",
    "baddbmm",
    "linear",
    "scaled_dot_product_attention",
];

/// CUDA's lists besides [`LOWER`] (libtorch registers them for CUDA, XPU and others).
const CUDA: &[(&str, Policy)] = &[
    ("einsum", Policy::Lower),
    ("acos", Policy::Float),
    ("asin", Policy::Float),
    ("cosh", Policy::Float),
    ("erfinv", Policy::Float),
    ("exp", Policy::Float),
    ("expm1", Policy::Float),
    ("log", Policy::Float),
    ("log10", Policy::Float),
    ("log2", Policy::Float),
    ("log1p", Policy::Float),
    ("reciprocal", Policy::Float),
    ("rsqrt", Policy::Float),
    ("sinh", Policy::Float),
    ("tan", Policy::Float),
    ("pow", Policy::Float),
    ("softplus", Policy::Float),
    ("layer_norm", Policy::Float),
    ("group_norm", Policy::Float),
    ("norm", Policy::Float),
    ("cosine_similarity", Policy::Float),
    ("nll_loss", Policy::Float),
    ("kl_div", Policy::Float),
    ("l1_loss", Policy::Float),
    ("smooth_l1_loss", Policy::Float),
    ("huber_loss", Policy::Float),
    ("mse_loss", Policy::Float),
    ("binary_cross_entropy_with_logits", Policy::Float),
    ("logsumexp", Policy::Float),
    ("upsample_nearest1d", Policy::Float),
    ("upsample_nearest2d", Policy::Float),
    ("upsample_bilinear2d", Policy::Float),
    ("softmax", Policy::Float),
    ("log_softmax", Policy::Float),
    ("cross_entropy_for_logits", Policy::Float),
    ("cross_entropy_loss", Policy::Float),
    ("cumsum", Policy::Float),
    ("cumprod", Policy::Float),
    ("sum", Policy::Float),
    ("prod", Policy::Float),
    ("index_put", Policy::Promote),
    ("scatter_add", Policy::Promote),
];

/// The CPU's lists besides [`LOWER`] (`AutocastCPU` in libtorch's `autocast_mode.cpp`): fewer
/// ops in `Float`; `softmax`, `layer_norm` and `sum` run in the kind that reaches them.
const CPU: &[(&str, Policy)] = &[
    ("avg_pool3d", Policy::Float),
    ("max_pool3d", Policy::Float),
    ("prod", Policy::Float),
    ("mse_loss", Policy::Float),
    ("nll_loss", Policy::Float),
    ("l1_loss", Policy::Float),
    ("smooth_l1_loss", Policy::Float),
    ("huber_loss", Policy::Float),
    ("kl_div", Policy::Float),
    ("ctc_loss", Policy::Float),
    ("ctc_loss_tensor", Policy::Float),
    ("binary_cross_entropy_with_logits", Policy::Float),
    ("cross_entropy_loss", Policy::Float),
    // tch's `cross_entropy_for_logits` takes its log-softmax in `Float` (toma's in the logits'
    // kind, outside a region).
    ("cross_entropy_for_logits", Policy::Float),
    ("cat", Policy::Promote),
];

/// The policy of op `name` on `device`, if autocast casts it there.
pub(crate) fn policy(device: DeviceType, name: &str) -> Option<Policy> {
    if LOWER.contains(&name) {
        return Some(Policy::Lower);
    }
    let list = match device {
        DeviceType::Cpu => CPU,
        DeviceType::Cuda => CUDA,
    };
    list.iter().find(|(n, _)| *n == name).map(|&(_, p)| p)
}

/// Whether autocast casts a value of `kind`: floating, and not `Double`.
pub(crate) fn eligible(kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::Half | Kind::BFloat16)
}

/// Whether two operands' kinds may differ because an autocast region is open on their device:
/// a listed op gets them cast alike ([`target`]); another runs with them as they come, as under
/// libtorch's autocast (a `BFloat16` activation beside a `Float` weight in a CPU layer norm).
pub(crate) fn mixes(a: &Node, b: &Node) -> bool {
    eligible(a.meta.kind) && eligible(b.meta.kind) && crate::autocast::active(a.meta.device).is_some()
}

/// The kind an open autocast region casts the eligible inputs of op `name` on `device` to,
/// given its inputs' kinds; `None` when no region is open there, autocast does not list the
/// op, or (promoting) the inputs agree already. The op's output takes that kind too.
pub(crate) fn target(device: Device, name: &str, mut kinds: impl Iterator<Item = Kind>) -> Option<Kind> {
    // Most ops are recorded outside any region: a thread-local read says so first.
    let t = DeviceType::of(device)?;
    let region = crate::autocast::region(t);
    if region.is_none() && t == DeviceType::Cpu {
        return None;
    }
    // Then whether tch opened one (a call into libtorch, cheaper than finding the op's name
    // among the lists, which only matters when one is open).
    let lower = region.or_else(|| crate::autocast::opened_by_tch(t))?;
    let policy = policy(t, name)?;
    match policy {
        Policy::Lower => Some(lower),
        Policy::Float => Some(Kind::Float),
        Policy::Promote => {
            let first = kinds.find(|&k| eligible(k))?;
            let mut widest = first;
            for k in kinds.filter(|&k| eligible(k)) {
                if k != widest {
                    widest = Kind::Float;
                }
            }
            (widest != first || widest == Kind::Float).then_some(widest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ops are named once, and every name is one of toma's ops or a unary/binary row.
    #[test]
    fn each_list_names_an_op_once() {
        for list in [CPU, CUDA] {
            let mut names: Vec<&str> = list.iter().map(|(n, _)| *n).chain(LOWER.iter().copied()).collect();
            names.sort_unstable();
            let before = names.len();
            names.dedup();
            assert_eq!(before, names.len(), "an op listed twice");
        }
        assert_eq!(policy(DeviceType::Cpu, "linear"), Some(Policy::Lower));
        assert_eq!(policy(DeviceType::Cpu, "softmax"), None, "the CPU keeps softmax as it comes");
        assert_eq!(policy(DeviceType::Cuda, "softmax"), Some(Policy::Float));
    }
}
