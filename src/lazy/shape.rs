//! Shape rules: what libtorch would produce, computed without running anything.
//!
//! Every function here returns the reason as a `String` on failure; the op that records
//! wraps it into a [`LazyError`](super::LazyError) naming itself and the shapes.

use tch::Kind;

use crate::dims::Dims;

/// Number of elements of a shape.
pub(crate) fn numel(shape: &[i64]) -> i64 {
    shape.iter().product()
}

/// Row-major strides of a fresh tensor of this shape, as libtorch gives them.
pub(crate) fn contiguous_strides(shape: &[i64]) -> Dims {
    let mut strides = Dims::zeros(shape.len());
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i].max(1);
    }
    strides
}

/// Whether (shape, strides) is row-major contiguous (size-1 dims may have any stride).
pub(crate) fn is_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    if numel(shape) == 0 {
        return true;
    }
    let mut expected = 1;
    for i in (0..shape.len()).rev() {
        if shape[i] != 1 {
            if strides[i] != expected {
                return false;
            }
            expected *= shape[i];
        }
    }
    true
}

/// A dimension index, negative counting from the end, checked against `ndim` (a 0-dim tensor
/// takes 0 and -1, as in libtorch).
pub(crate) fn wrap_dim(dim: i64, ndim: usize) -> Result<usize, String> {
    let n = ndim.max(1) as i64;
    if dim < -n || dim >= n {
        return Err(format!("dimension {dim} is out of range (expected to be in [{}, {}])", -n, n - 1));
    }
    Ok(if dim < 0 { dim + n } else { dim } as usize)
}

/// Like [`wrap_dim`] for an insertion point (`unsqueeze`): `ndim + 1` positions.
pub(crate) fn wrap_insert_dim(dim: i64, ndim: usize) -> Result<usize, String> {
    wrap_dim(dim, ndim + 1)
}

/// Wraps a list of dimensions, refusing repeats.
pub(crate) fn wrap_dims(dims: &[i64], ndim: usize) -> Result<Vec<usize>, String> {
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let w = wrap_dim(d, ndim)?;
        if out.contains(&w) {
            return Err(format!("dimension {d} appears more than once"));
        }
        out.push(w);
    }
    Ok(out)
}

/// Numpy-style broadcasting of two shapes.
pub(crate) fn broadcast(a: &[i64], b: &[i64]) -> Result<Dims, String> {
    let n = a.len().max(b.len());
    let mut out = Dims::zeros(n);
    for (i, slot) in out.iter_mut().enumerate() {
        let x = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let y = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        *slot = if x == y || y == 1 {
            x
        } else if x == 1 {
            y
        } else {
            return Err(format!(
                "the size of tensor a ({x}) must match the size of tensor b ({y}) at non-singleton dimension {i}"
            ));
        };
    }
    Ok(out)
}

/// Dimensions as a bit set (bit d for dimension d; dimensions past 63 are left out).
pub(crate) fn dims_mask(dims: impl IntoIterator<Item = usize>) -> u64 {
    dims.into_iter().filter(|&d| d < 64).fold(0, |mask, d| mask | 1 << d)
}

/// The dimensions of `out` (bit d for dimension d) that an operand of shape `operand`
/// was broadcast along: its gradient is the output's summed over them.
pub(crate) fn broadcast_mask(operand: &[i64], out: &[i64]) -> u64 {
    let lead = out.len().saturating_sub(operand.len());
    (0..out.len().min(64)).fold(0, |mask, d| {
        let broadcast = d < lead || (operand[d - lead] == 1 && out[d] != 1);
        if broadcast {
            mask | 1 << d
        } else {
            mask
        }
    })
}

/// The output shape of `matmul`, following `torch.matmul`'s rules for 1-D and batched operands.
pub(crate) fn matmul(a: &[i64], b: &[i64]) -> Result<Dims, String> {
    if a.is_empty() || b.is_empty() {
        return Err("both arguments to matmul need to be at least 1D".into());
    }
    let lhs: Dims = if a.len() == 1 { [1, a[0]].into() } else { a.into() };
    let rhs: Dims = if b.len() == 1 { [b[0], 1].into() } else { b.into() };
    let (n, k) = (lhs[lhs.len() - 2], lhs[lhs.len() - 1]);
    let (k2, m) = (rhs[rhs.len() - 2], rhs[rhs.len() - 1]);
    if k != k2 {
        return Err(format!("contraction sizes differ: {k} (last of the first) and {k2} (of the second)"));
    }
    let mut out = broadcast(&lhs[..lhs.len() - 2], &rhs[..rhs.len() - 2])?;
    if a.len() > 1 {
        out.push(n);
    }
    if b.len() > 1 {
        out.push(m);
    }
    Ok(out)
}

/// `size` with at most one `-1` filled in so that it holds `total` elements.
pub(crate) fn infer_size(size: &[i64], total: i64) -> Result<Dims, String> {
    let mut infer = None;
    let mut product = 1i64;
    for (i, &s) in size.iter().enumerate() {
        if s == -1 {
            if infer.is_some() {
                return Err("only one dimension can be inferred".into());
            }
            infer = Some(i);
        } else if s < 0 {
            return Err(format!("invalid shape dimension {s}"));
        } else {
            product *= s;
        }
    }
    let mut out = Dims::from(size);
    match infer {
        Some(i) => {
            if product == 0 || total % product != 0 {
                return Err(format!("shape {size:?} is invalid for input of size {total}"));
            }
            out[i] = total / product;
        }
        None if product != total => return Err(format!("shape {size:?} is invalid for input of size {total}")),
        None => {}
    }
    Ok(out)
}

/// The strides libtorch gives an elementwise op's output of shape `out` on `operands` (each
/// `(shape, strides)`, broadcast to `out`): `TensorIterator` orders the dimensions by the
/// operands' strides, the first operand that tells two dimensions apart deciding (a broadcast
/// one, stride 0, tells nothing), and lays the output out densely in that order
/// (`TensorIteratorBase::reorder_dimensions` in libtorch 2.11). A transposed input gives a
/// transposed output; contiguous inputs give a contiguous one.
pub(crate) fn elementwise_strides(out: &[i64], operands: &[(&[i64], &[i64])]) -> Dims {
    // Contiguous operands (broadcast or not) order every dimension as written: the common case,
    // decided without a sort.
    if operands.iter().all(|(shape, strides)| is_contiguous(shape, strides)) {
        return contiguous_strides(out);
    }
    let n = out.len();
    // Each operand's strides over `out`'s dimensions: 0 where it is broadcast.
    let strides: Vec<Vec<i64>> = operands
        .iter()
        .filter(|(shape, strides)| shape.len() == strides.len() && shape.len() <= n)
        .map(|(shape, strides)| {
            let lead = n - shape.len();
            (0..n)
                .map(|d| if d < lead || (shape[d - lead] == 1 && out[d] != 1) { 0 } else { strides[d - lead] })
                .collect()
        })
        .collect();
    // Whether `a` should sit inside `b` (1), outside (-1), or either (0).
    let should_swap = |a: usize, b: usize| -> i32 {
        for s in &strides {
            let (sa, sb) = (s[a], s[b]);
            if sa == 0 || sb == 0 {
                continue;
            }
            if sa < sb {
                return -1;
            }
            if sa > sb {
                return 1;
            }
            if out[a] > out[b] {
                return 1;
            }
        }
        0
    };
    // Innermost first, as libtorch's `perm_` starts reversed; an insertion sort as its.
    let mut perm: Vec<usize> = (0..n).rev().collect();
    for i in 1..n {
        let mut dim1 = i;
        for dim0 in (0..i).rev() {
            let c = should_swap(perm[dim0], perm[dim1]);
            if c > 0 {
                perm.swap(dim0, dim1);
                dim1 = dim0;
            } else if c < 0 {
                break;
            }
        }
    }
    let mut result = contiguous_strides(out);
    let mut stride = 1;
    for &d in &perm {
        result[d] = stride;
        stride *= out[d].max(1);
    }
    result
}

/// For a view of (`from`, `from_strides`) as (`to`, `to_strides`) that only reorders the
/// dimensions (a transpose, a permute): which dimension of `from` each of `to`'s is. `None`
/// for any other view.
pub(crate) fn permutation(from: &[i64], from_strides: &[i64], to: &[i64], to_strides: &[i64]) -> Option<Vec<usize>> {
    let mut order = Vec::with_capacity(to.len());
    reorders(from, from_strides, to, to_strides, |_, d| order.push(d)).then_some(order)
}

/// Whether such a view reorders dimensions other than ones of size 1 (it is not the identity).
pub(crate) fn permutes(from: &[i64], from_strides: &[i64], to: &[i64], to_strides: &[i64]) -> bool {
    // Dimensions of size 1 may land anywhere; the others must keep their order.
    let (mut moved, mut last) = (false, None);
    reorders(from, from_strides, to, to_strides, |o, d| {
        if to[o] != 1 {
            moved |= last.is_some_and(|l| d < l);
            last = Some(d);
        }
    }) && moved
}

/// Matches each of `to`'s dimensions with one of `from`'s of its size and stride (any stride
/// at size 1), calling `found(to's, from's)`; whether every one matched.
fn reorders(
    from: &[i64],
    from_strides: &[i64],
    to: &[i64],
    to_strides: &[i64],
    mut found: impl FnMut(usize, usize),
) -> bool {
    if from.len() != to.len() || from.len() > 64 || from_strides.len() != from.len() || to_strides.len() != to.len() {
        return false;
    }
    let mut used = 0u64;
    for (o, (&size, &stride)) in to.iter().zip(to_strides).enumerate() {
        let Some(d) = (0..from.len())
            .find(|&d| used & (1 << d) == 0 && from[d] == size && (size == 1 || from_strides[d] == stride))
        else {
            return false;
        };
        used |= 1 << d;
        found(o, d);
    }
    true
}

/// The strides a view of (`old_shape`, `old_strides`) as `new_shape` would have, or `None` when
/// no view is possible and `reshape` must copy (a port of c10's `computeStride`).
pub(crate) fn view_strides(old_shape: &[i64], old_strides: &[i64], new_shape: &[i64]) -> Option<Dims> {
    if old_shape.is_empty() {
        return Some(std::iter::repeat_n(1, new_shape.len()).collect());
    }
    let total = numel(old_shape);
    let mut new_strides = Dims::zeros(new_shape.len());
    if total == 0 {
        if old_shape == new_shape {
            return Some(old_strides.into());
        }
        return Some(contiguous_strides(new_shape));
    }
    let mut view_d = new_shape.len() as i64 - 1;
    let mut chunk_base_stride = *old_strides.last().expect("non-empty");
    let mut tensor_numel = 1i64;
    let mut view_numel = 1i64;
    for tensor_d in (0..old_shape.len()).rev() {
        tensor_numel *= old_shape[tensor_d];
        if tensor_d == 0
            || (old_shape[tensor_d - 1] != 1 && old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)
        {
            while view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d as usize] == 1) {
                new_strides[view_d as usize] = view_numel * chunk_base_stride;
                view_numel *= new_shape[view_d as usize];
                view_d -= 1;
            }
            if view_numel != tensor_numel {
                return None;
            }
            if tensor_d > 0 {
                chunk_base_stride = old_strides[tensor_d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    (view_d == -1).then_some(new_strides)
}

/// Output length of a convolution or pooling window along one dimension
/// (`pooling_output_shape` in ATen when `ceil_mode` is given).
pub(crate) fn window_out(input: i64, kernel: i64, pad: i64, stride: i64, dilation: i64, ceil_mode: bool) -> i64 {
    let effective = dilation * (kernel - 1) + 1;
    let numerator = input + 2 * pad - effective + if ceil_mode { stride - 1 } else { 0 };
    let mut out = numerator.div_euclid(stride) + 1;
    if ceil_mode && (out - 1) * stride >= input + pad {
        out -= 1;
    }
    out
}

/// Expands a 1- or 2-element list to a pair (`[k]` means `[k, k]`), as tch's IntList takes it.
pub(crate) fn pair(values: &[i64], what: &str) -> Result<[i64; 2], String> {
    spatial(values, what)
}

/// Expands a list of 1 or `D` elements to `D` (`[k]` means `k` along every dimension).
pub(crate) fn spatial<const D: usize>(values: &[i64], what: &str) -> Result<[i64; D], String> {
    match values {
        [a] => Ok([*a; D]),
        v if v.len() == D => Ok(v.try_into().expect("length checked")),
        _ if D == 1 => Err(format!("{what} must have 1 element, got {values:?}")),
        _ => Err(format!("{what} must have 1 or {D} elements, got {values:?}")),
    }
}

/// Output shape of a convolution over `D` spatial dimensions (`[N, C, ..]` or unbatched
/// `[C, ..]` input, `[O, C / groups, k..]` weight).
pub(crate) fn conv<const D: usize>(
    input: &[i64],
    weight: &[i64],
    bias: Option<&[i64]>,
    stride: [i64; D],
    padding: [i64; D],
    dilation: [i64; D],
    groups: i64,
) -> Result<Dims, String> {
    if input.len() != D + 1 && input.len() != D + 2 {
        return Err(format!(
            "expected a {}-D (unbatched) or {}-D (batched) input, got {} dims",
            D + 1,
            D + 2,
            input.len()
        ));
    }
    if weight.len() != D + 2 {
        return Err(format!("expected a {}-D weight, got {} dims", D + 2, weight.len()));
    }
    if groups < 1 || stride.iter().any(|&s| s < 1) || dilation.iter().any(|&d| d < 1) || padding.iter().any(|&p| p < 0)
    {
        return Err(format!(
            "need groups >= 1, stride >= 1, dilation >= 1 and padding >= 0, got groups {groups}, stride {stride:?}, \
             dilation {dilation:?}, padding {padding:?}"
        ));
    }
    let batched = input.len() == D + 2;
    let (c, sizes) = if batched { (input[1], &input[2..]) } else { (input[0], &input[1..]) };
    if weight[0] % groups != 0 {
        return Err(format!("out channels {} are not divisible by groups {groups}", weight[0]));
    }
    if weight[1] * groups != c {
        return Err(format!(
            "expected input to have {} channels (weight {weight:?}, groups {groups}), but got {c} channels",
            weight[1] * groups
        ));
    }
    if let Some(bias) = bias {
        if bias != [weight[0]] {
            return Err(format!("bias of shape {bias:?} does not match {} output channels", weight[0]));
        }
    }
    let mut out = Dims::new();
    if batched {
        out.push(input[0]);
    }
    out.push(weight[0]);
    for (i, &size) in sizes.iter().enumerate() {
        let effective = dilation[i] * (weight[2 + i] - 1) + 1;
        if size + 2 * padding[i] < effective {
            return Err(format!(
                "input size per channel ({sizes:?}, padded by {padding:?}) is smaller than the kernel ({:?}, dilation \
                 {dilation:?})",
                &weight[2..]
            ));
        }
        out.push(window_out(size, weight[2 + i], padding[i], stride[i], dilation[i], false));
    }
    Ok(out)
}

/// Output shape of 2-D max/avg pooling. `dilation` is `[1, 1]` for average pooling.
pub(crate) fn pool2d(
    input: &[i64],
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    dilation: [i64; 2],
    ceil_mode: bool,
) -> Result<Dims, String> {
    if input.len() != 3 && input.len() != 4 {
        return Err(format!("expected a 3-D or 4-D input, got {} dims", input.len()));
    }
    if kernel.iter().any(|&k| k < 1) || stride.iter().any(|&s| s < 1) || dilation.iter().any(|&d| d < 1) {
        return Err(format!("kernel {kernel:?}, stride {stride:?} and dilation {dilation:?} must be positive"));
    }
    let n = input.len();
    if input[n - 3..].contains(&0) {
        return Err("expected non-empty channels and spatial dimensions".into());
    }
    let mut out = Dims::from(input);
    for i in 0..2 {
        // libtorch compares with half the kernel, not the dilated one.
        let limit = kernel[i] / 2;
        if padding[i] < 0 || padding[i] > limit {
            return Err(format!(
                "pad should be at most half of effective kernel size, got padding {padding:?} for kernel {kernel:?}"
            ));
        }
        let size = window_out(input[n - 2 + i], kernel[i], padding[i], stride[i], dilation[i], ceil_mode);
        if size < 1 {
            return Err(format!("output size is too small ({size}) for input {:?}", &input[n - 2..]));
        }
        out[n - 2 + i] = size;
    }
    Ok(out)
}

/// Torch's type categories, for promotion: bool < integral < floating.
fn category(kind: Kind) -> u8 {
    match kind {
        Kind::Bool => 0,
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 => 1,
        _ => 2,
    }
}

/// Whether a kind is a floating-point one.
pub(crate) fn is_floating(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}

/// Whether an op whose output is of kind `output` promoted an input of kind `input` (`f32 +
/// bf16` under autocast): the CPU's kernels copy such an input into the output's kind, and
/// autograd casts its gradient back to its own.
pub(crate) fn promoted(input: Kind, output: Kind) -> bool {
    input != output && is_floating(input) && is_floating(output)
}

/// Whether a kind is an integer (or bool) one.
pub(crate) fn is_integral(kind: Kind) -> bool {
    category(kind) < 2
}

fn rank(kind: Kind) -> u8 {
    match kind {
        Kind::Bool => 0,
        Kind::Uint8 => 1,
        Kind::Int8 => 2,
        Kind::Int16 => 3,
        Kind::Int => 4,
        Kind::Int64 => 5,
        Kind::Half => 6,
        Kind::BFloat16 => 7,
        Kind::Float => 8,
        Kind::Double => 9,
        _ => 10,
    }
}

/// Promotion of two kinds (the common cases of `torch.promote_types`).
pub(crate) fn promote(a: Kind, b: Kind) -> Kind {
    if a == b {
        return a;
    }
    match (a, b) {
        (Kind::Uint8, Kind::Int8) | (Kind::Int8, Kind::Uint8) => Kind::Int16,
        (Kind::Half, Kind::BFloat16) | (Kind::BFloat16, Kind::Half) => Kind::Float,
        _ => {
            if rank(a) >= rank(b) {
                a
            } else {
                b
            }
        }
    }
}

/// The result kind of a binary op between two tensors (`torch.result_type`): a 0-dim operand
/// only counts when its category is higher than the other's.
pub(crate) fn result_kind(a: Kind, a_dims: usize, b: Kind, b_dims: usize) -> Kind {
    match (a_dims == 0, b_dims == 0) {
        (false, true) if category(b) <= category(a) => a,
        (true, false) if category(a) <= category(b) => b,
        _ => promote(a, b),
    }
}

/// The result kind of a tensor with a Rust `f64` scalar: a float scalar makes integral
/// tensors the default float kind.
pub(crate) fn scalar_result_kind(kind: Kind) -> Kind {
    if is_integral(kind) {
        Kind::Float
    } else {
        kind
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's elementwise output keeps a transposed input's order, and only a dense one's.
    #[cfg(feature = "tch")]
    #[test]
    fn elementwise_outputs_are_laid_out_as_libtorch_lays_them() {
        use tch::{Device, IndexOp, Kind, Tensor};
        let x = Tensor::randn([4, 3, 5], (Kind::Float, Device::Cpu));
        for input in
            [x.transpose(1, 2), x.permute([2, 0, 1]), x.i((.., .., 1..4)), x.shallow_clone(), x.i((.., 0..1, ..))]
        {
            let out = input.sigmoid();
            let want = elementwise_strides(&input.size(), &[(&input.size(), &input.stride())]);
            // Size-1 dimensions' strides do not matter to a view.
            let matters = |s: &[i64]| -> Vec<i64> {
                s.iter().zip(out.size()).filter(|(_, n)| *n != 1).map(|(s, _)| *s).collect()
            };
            assert_eq!(matters(&want), matters(&out.stride()), "input strides {:?}", input.stride());
        }
        // Two operands: the first that tells the dimensions apart decides; a broadcast one
        // tells nothing.
        let y = Tensor::randn([4, 5, 3], (Kind::Float, Device::Cpu));
        let row = Tensor::randn([1, 5, 1], (Kind::Float, Device::Cpu));
        let pairs = [
            (x.transpose(1, 2), y.shallow_clone()),
            (y.shallow_clone(), x.transpose(1, 2)),
            (row.shallow_clone(), x.transpose(1, 2)),
            (x.transpose(1, 2), x.transpose(1, 2)),
            (x.permute([0, 2, 1]).i((.., .., 0..3)), y.shallow_clone()),
        ];
        for (a, b) in pairs {
            let out = &a + &b;
            let want = elementwise_strides(&out.size(), &[(&a.size(), &a.stride()), (&b.size(), &b.stride())]);
            let matters = |s: &[i64]| -> Vec<i64> {
                s.iter().zip(out.size()).filter(|(_, n)| *n != 1).map(|(s, _)| *s).collect()
            };
            assert_eq!(matters(&want), matters(&out.stride()), "operands {:?} and {:?}", a.stride(), b.stride());
        }
    }

    #[test]
    fn broadcast_rules() {
        assert_eq!(broadcast(&[3, 1, 5], &[4, 1]).unwrap(), [3, 4, 5]);
        assert_eq!(broadcast(&[], &[2, 3]).unwrap(), [2, 3]);
        assert!(broadcast(&[3], &[4]).is_err());
    }

    #[test]
    fn permutations_of_views() {
        // [2, 3, 4] transposed (1, 2): each dimension keeps its stride.
        assert_eq!(permutation(&[2, 3, 4], &[12, 4, 1], &[2, 4, 3], &[12, 1, 4]), Some(vec![0, 2, 1]));
        // A view that merges or splits dimensions is not a permutation.
        assert_eq!(permutation(&[4, 8], &[8, 1], &[8, 4], &[4, 1]), None);
        assert_eq!(permutation(&[2, 3, 4], &[12, 4, 1], &[6, 4], &[4, 1]), None);
        assert!(permutes(&[2, 3, 4], &[12, 4, 1], &[2, 4, 3], &[12, 1, 4]));
        // The same view, or one moving only a dimension of size 1, reorders nothing.
        assert!(!permutes(&[2, 3, 4], &[12, 4, 1], &[2, 3, 4], &[12, 4, 1]));
        assert!(!permutes(&[2, 1, 4], &[4, 4, 1], &[1, 2, 4], &[4, 4, 1]));
    }

    #[test]
    fn matmul_rules() {
        assert_eq!(matmul(&[3], &[3]).unwrap(), Vec::<i64>::new());
        assert_eq!(matmul(&[2, 3], &[3]).unwrap(), [2]);
        assert_eq!(matmul(&[3], &[3, 4]).unwrap(), [4]);
        assert_eq!(matmul(&[5, 1, 2, 3], &[4, 3, 6]).unwrap(), [5, 4, 2, 6]);
        assert!(matmul(&[2, 3], &[4, 5]).is_err());
    }

    #[test]
    fn views_and_copies() {
        // A transposed matrix cannot be flattened without a copy; a contiguous one can.
        assert_eq!(view_strides(&[2, 3], &[3, 1], &[6]), Some([1].into()));
        assert_eq!(view_strides(&[3, 2], &[1, 3], &[6]), None);
        assert_eq!(view_strides(&[4, 6], &[6, 1], &[4, 2, 3]), Some([6, 3, 1].into()));
        assert_eq!(infer_size(&[-1, 3], 12).unwrap(), [4, 3]);
        assert!(infer_size(&[-1, 5], 12).is_err());
    }

    #[test]
    fn windows() {
        assert_eq!(window_out(5, 2, 0, 2, 1, false), 2);
        assert_eq!(window_out(5, 2, 0, 2, 1, true), 3);
        assert_eq!(window_out(32, 3, 1, 1, 1, false), 32);
    }

    #[test]
    fn kinds() {
        assert_eq!(result_kind(Kind::Float, 2, Kind::Double, 0), Kind::Float);
        assert_eq!(result_kind(Kind::Int64, 2, Kind::Double, 0), Kind::Double);
        assert_eq!(result_kind(Kind::Float, 2, Kind::Double, 1), Kind::Double);
        assert_eq!(scalar_result_kind(Kind::Int64), Kind::Float);
    }
}
