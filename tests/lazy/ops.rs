//! Every op, against tch run eagerly on random valid (and invalid) shapes: the recorded shape
//! and kind are tch's, recording fails exactly when tch fails, and the value computed lazily —
//! whole, and in random micro-batches concatenated or combined — is tch's value.
#![cfg(feature = "tch")]

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tch::{Device, Kind, Reduction, TchError, Tensor};
use toma::lazy::{lazy, LazyError, LazyTensor, Options};

const CPU: Device = Device::Cpu;
const F64: (Kind, Device) = (Kind::Double, CPU);

/// `n` cases, or `PROPTEST_CASES` when set (for deeper runs than CI's).
fn cases(n: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(n);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// Whether splitting the batch keeps the op's value (the test's expectation).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Split {
    /// Micro-batches reproduce the value.
    Exact,
    /// The op mixes samples: a forced split is refused.
    Refused,
    /// Random (dropout): compare shapes only.
    Shape,
}

/// Compares an eager tch result with the lazy one.
fn agree(
    what: &str,
    eager: Result<Tensor, TchError>,
    lazy_result: Result<LazyTensor, LazyError>,
    micro: usize,
    split: Split,
) -> Result<(), TestCaseError> {
    let (eager, lazy_t) = match (eager, lazy_result) {
        (Err(_), Err(_)) => return Ok(()),
        (Ok(e), Err(l)) => {
            return Err(TestCaseError::fail(format!("{what}: tch gives {:?}, lazy fails: {l}", e.size())))
        }
        (Err(e), Ok(l)) => {
            return Err(TestCaseError::fail(format!("{what}: tch fails ({e}), lazy records {:?}", l.size())))
        }
        (Ok(e), Ok(l)) => (e, l),
    };
    prop_assert_eq!(lazy_t.size(), eager.size(), "{}: shape", what);
    prop_assert_eq!(lazy_t.kind(), eager.kind(), "{}: kind", what);
    let whole = lazy_t.to_tensor().map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    if split == Split::Shape {
        prop_assert_eq!(whole.size(), eager.size());
        return Ok(());
    }
    close(what, &whole, &eager)?;
    let forced = Options::new().micro_batch(micro);
    match (lazy_t.to_tensor_with(&forced), split) {
        (Ok(chunked), Split::Exact) => close(&format!("{what} in micro-batches of {micro}"), &chunked, &eager)?,
        (Err(e), Split::Exact) => {
            return Err(TestCaseError::fail(format!("{what}: micro-batches of {micro} fail: {e}")));
        }
        (Err(LazyError::MixesBatch { .. } | LazyError::NotSplittable { .. }), Split::Refused) => {}
        (Ok(_), Split::Refused) if lazy_t.batch_size().is_none_or(|n| micro >= n) => {}
        (other, Split::Refused) => {
            return Err(TestCaseError::fail(format!(
                "{what}: a split should be refused, got {:?}",
                other.map(|t| t.size())
            )));
        }
        (_, Split::Shape) => unreachable!(),
    }
    Ok(())
}

fn close(what: &str, a: &Tensor, b: &Tensor) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.size(), b.size(), "{}: shape", what);
    prop_assert_eq!(a.kind(), b.kind(), "{}: kind", what);
    let (a64, b64) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    // Micro-batches sum in another order: exact up to rounding of the kind.
    let tol = if b.kind() == Kind::Double { 1e-9 } else { 1e-5 };
    let ok = a64.isclose(&b64, tol, tol, true).all().int64_value(&[]) == 1;
    prop_assert!(ok, "{}: values differ\nlazy {}\ntch {}", what, a, b);
    Ok(())
}

/// A shape of 1..=max_dims dims with sizes 1..=max_size.
fn shape(max_dims: usize, max_size: i64) -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec(1..=max_size, 1..=max_dims)
}

/// A shape `b` that broadcasts against `a`: trailing dims of `a`, some set to 1; the batch
/// dimension (0 of `a`) is dropped or set to 1 when `b` is fixed.
fn broadcast_partner(a: Vec<i64>, fixed: bool) -> impl Strategy<Value = (Vec<i64>, Vec<i64>)> {
    let n = a.len();
    (0..n, prop::collection::vec(any::<bool>(), n)).prop_map(move |(drop, ones)| {
        let start = if fixed { drop.max(1).min(n) } else { drop.min(n - 1) };
        let mut b: Vec<i64> = a[start..].to_vec();
        for (i, one) in ones.iter().enumerate().take(b.len()) {
            if *one {
                b[i] = 1;
            }
        }
        if fixed && start == 0 && !b.is_empty() {
            b[0] = 1;
        }
        (a.clone(), b)
    })
}

fn randn(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, F64)
}

proptest! {
    #![proptest_config(cases(96))]

    #[test]
    fn elementwise_binary_with_broadcasting(
        (a, b) in shape(4, 4).prop_flat_map(|a| broadcast_partner(a, true)),
        both in any::<bool>(),
        micro in 1usize..5,
        op in 0usize..12,
    ) {
        let (ta, tb) = (randn(&a), randn(&b));
        // With `both`, the partner is batched too (same leading size when it has dimension 0).
        let tb = if both && b.len() == a.len() { randn(&[&a[..1], &b[1..]].concat()) } else { tb };
        let la = lazy(&ta, 0);
        let lb = if both && tb.dim() == ta.dim() { lazy(&tb, 0) } else { LazyTensor::fixed(&tb) };
        let pos = |t: &Tensor| t.abs() + 0.5;
        let (eager, lazy_t, name) = match op {
            0 => (ta.f_add(&tb), la.f_add(&lb), "add"),
            1 => (ta.f_sub(&tb), la.f_sub(&lb), "sub"),
            2 => (ta.f_mul(&tb), la.f_mul(&lb), "mul"),
            3 => (ta.f_div(&tb), la.f_div(&lb), "div"),
            4 => (ta.f_maximum(&tb), la.f_maximum(&lb), "maximum"),
            5 => (ta.f_minimum(&tb), la.f_minimum(&lb), "minimum"),
            6 => (ta.f_eq_tensor(&tb), la.f_eq_tensor(&lb), "eq"),
            7 => (ta.f_lt_tensor(&tb), la.f_lt_tensor(&lb), "lt"),
            8 => (ta.f_ge_tensor(&tb), la.f_ge_tensor(&lb), "ge"),
            9 => (ta.f_ne_tensor(&tb), la.f_ne_tensor(&lb), "ne"),
            10 => {
                let (pa, la2) = (pos(&ta), lazy(&pos(&ta), 0));
                (pa.f_pow(&tb), la2.f_pow(&lb), "pow")
            }
            _ => (ta.f_le_tensor(&tb), la.f_le_tensor(&lb), "le"),
        };
        agree(&format!("{name} {a:?} {b:?}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn mismatched_broadcasts_fail_like_tch(a in shape(3, 4), b in shape(3, 4), micro in 1usize..4) {
        let (ta, tb) = (randn(&a), randn(&b));
        let lb = LazyTensor::fixed(&tb);
        // A fixed operand with the batch's size along the batch dimension is refused even
        // where tch would broadcast: it cannot be split with the batch.
        let eager = ta.f_add(&tb);
        let lazy_t = lazy(&ta, 0).f_add(&lb);
        let aligned = a[0] > 1 && b.len() >= a.len() && b[b.len() - a.len()] == a[0];
        if aligned && eager.is_ok() {
            let refused = matches!(lazy_t, Err(LazyError::Batch { .. }));
            prop_assert!(refused, "a fixed operand of the batch's size must be refused");
        } else {
            agree("add", eager, lazy_t, micro, Split::Exact)?;
        }
    }

    #[test]
    fn scalar_ops(a in shape(3, 5), s in -3.0f64..3.0, micro in 1usize..5, op in 0usize..11, int in any::<bool>()) {
        let t = if int { Tensor::randint(7, a.as_slice(), (Kind::Int64, CPU)) } else { randn(&a) };
        let l = lazy(&t, 0);
        let s = if s.abs() < 0.1 { 0.7 } else { s };
        let (eager, lazy_t, name) = match op {
            0 => (Ok(&t + s), l.f_add_scalar(s), "add_scalar"),
            1 => (Ok(&t - s), l.f_sub_scalar(s), "sub_scalar"),
            2 => (Ok(s - &t), l.f_rsub_scalar(s), "rsub_scalar"),
            3 => (Ok(&t * s), l.f_mul_scalar(s), "mul_scalar"),
            4 => (Ok(&t / s), l.f_div_scalar(s), "div_scalar"),
            5 => (Ok(t.abs().to_kind(Kind::Double).pow_tensor_scalar(s)), lazy(&t.abs().to_kind(Kind::Double), 0).f_pow_tensor_scalar(s), "pow"),
            6 => (Ok(t.lt(s)), l.f_lt(s), "lt"),
            7 => (Ok(t.ge(s)), l.f_ge(s), "ge"),
            8 => (Ok(t.eq(s.round())), l.f_eq(s.round()), "eq"),
            9 => {
                let p = t.abs().to_kind(Kind::Double) + 1.0;
                (Ok(s / &p), Ok(s / &lazy(&p, 0)), "rdiv")
            }
            _ => (Ok(-&t.to_kind(Kind::Double)), Ok(-&lazy(&t.to_kind(Kind::Double), 0)), "neg"),
        };
        agree(&format!("{name} {a:?} {s}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn unary_and_softmax(a in shape(4, 5), micro in 1usize..6, op in 0usize..29, dim in -4i64..4) {
        let t = randn(&a);
        let l = lazy(&t, 0);
        let split = if (op == 9 || op == 10) && dim.rem_euclid(a.len() as i64) == 0 && dim >= -(a.len() as i64) && dim < a.len() as i64 {
            Split::Refused
        } else {
            Split::Exact
        };
        let (eager, lazy_t, name) = match op {
            0 => (t.f_relu(), l.f_relu(), "relu"),
            1 => (t.f_gelu("none"), l.f_gelu("none"), "gelu"),
            2 => (t.f_gelu("tanh"), l.f_gelu("tanh"), "gelu tanh"),
            3 => (t.f_sigmoid(), l.f_sigmoid(), "sigmoid"),
            4 => (t.f_tanh(), l.f_tanh(), "tanh"),
            5 => (t.f_exp(), l.f_exp(), "exp"),
            6 => (t.abs().f_log(), lazy(&t.abs(), 0).f_log(), "log"),
            7 => (t.abs().f_sqrt(), lazy(&t.abs(), 0).f_sqrt(), "sqrt"),
            8 => (t.f_abs(), l.f_abs(), "abs"),
            9 => (t.f_softmax(dim, None), l.f_softmax(dim, None), "softmax"),
            10 => (t.f_log_softmax(dim, Kind::Float), l.f_log_softmax(dim, Kind::Float), "log_softmax"),
            11 => (t.f_silu(), l.f_silu(), "silu"),
            12 => (t.f_softplus(), l.f_softplus(), "softplus"),
            13 => (t.f_leaky_relu(), l.f_leaky_relu(), "leaky_relu"),
            14 => (t.f_elu(), l.f_elu(), "elu"),
            15 => (t.f_hardswish(), l.f_hardswish(), "hardswish"),
            16 => (t.f_hardsigmoid(), l.f_hardsigmoid(), "hardsigmoid"),
            17 => (t.f_relu6(), l.f_relu6(), "relu6"),
            18 => (t.f_sin(), l.f_sin(), "sin"),
            19 => (t.f_cos(), l.f_cos(), "cos"),
            20 => (t.f_square(), l.f_square(), "square"),
            21 => (t.f_clamp(-0.5, 0.7), l.f_clamp(-0.5, 0.7), "clamp"),
            22 => (t.f_clamp_min(-0.3), l.f_clamp_min(-0.3), "clamp_min"),
            23 => (t.f_clamp_max(0.2), l.f_clamp_max(0.2), "clamp_max"),
            24 => {
                let p = t.abs() + 0.5;
                (p.f_rsqrt(), lazy(&p, 0).f_rsqrt(), "rsqrt")
            }
            25 => {
                let p = t.abs() + 0.5;
                (p.f_reciprocal(), lazy(&p, 0).f_reciprocal(), "reciprocal")
            }
            26 => (t.f_erf(), l.f_erf(), "erf"),
            27 => (t.f_log_sigmoid(), l.f_log_sigmoid(), "log_sigmoid"),
            _ => (t.f_mish(), l.f_mish(), "mish"),
        };
        agree(&format!("{name} {a:?} dim {dim}"), eager, lazy_t, micro, split)?;
    }

    #[test]
    fn matmul_batched_and_broadcast(
        case in 0usize..7,
        n in 1i64..6,
        (k, m, r) in (1i64..5, 1i64..5, 1i64..4),
        extra in 1i64..3,
        micro in 1usize..6,
    ) {
        // Each case puts the batch somewhere else: leading dims, rows, columns, or contracted.
        let (a, b, la, lb): (Tensor, Tensor, LazyTensor, LazyTensor) = match case {
            0 => { let (a, b) = (randn(&[n, k]), randn(&[k, m])); let (la, lb) = (lazy(&a, 0), LazyTensor::fixed(&b)); (a, b, la, lb) }
            1 => { let (a, b) = (randn(&[n, r, k]), randn(&[k, m])); let (la, lb) = (lazy(&a, 0), LazyTensor::fixed(&b)); (a, b, la, lb) }
            2 => { let (a, b) = (randn(&[n, extra, r, k]), randn(&[n, 1, k, m])); let (la, lb) = lazy((&a, &b), 0); (a, b, la, lb) }
            3 => { let (a, b) = (randn(&[n, r, k]), randn(&[k])); let (la, lb) = (lazy(&a, 0), LazyTensor::fixed(&b)); (a, b, la, lb) }
            4 => { let (a, b) = (randn(&[r, k]), randn(&[k, n])); let (la, lb) = (LazyTensor::fixed(&a), lazy(&b, 1)); (a, b, la, lb) }
            5 => { let (a, b) = (randn(&[k, n]), randn(&[n, m])); let (la, lb) = (lazy(&a, 1), lazy(&b, 0)); (a, b, la, lb) }
            _ => { let (a, b) = (randn(&[extra, r, k]), randn(&[n, 1, k, m])); let (la, lb) = (LazyTensor::fixed(&a), lazy(&b, 0)); (a, b, la, lb) }
        };
        agree(&format!("matmul case {case} {:?} @ {:?}", a.size(), b.size()), a.f_matmul(&b), la.f_matmul(&lb), micro, Split::Exact)?;
    }

    #[test]
    fn matmul_shape_errors_like_tch(a in shape(3, 3), b in shape(3, 3)) {
        let (ta, tb) = (randn(&a), randn(&b));
        let (eager, lazy_t) = (ta.f_matmul(&tb), LazyTensor::fixed(&ta).f_matmul(&LazyTensor::fixed(&tb)));
        agree("matmul", eager, lazy_t, 1, Split::Exact)?;
    }

    #[test]
    fn linear_with_and_without_bias(n in 1i64..6, t in 0i64..3, (i, o) in (1i64..5, 1i64..5), bias in any::<bool>(), micro in 1usize..6) {
        let shape: Vec<i64> = if t == 0 { vec![n, i] } else { vec![n, t, i] };
        let (x, w, b) = (randn(&shape), randn(&[o, i]), randn(&[o]));
        let bias_t = bias.then_some(&b);
        agree("linear", x.f_linear(&w, bias_t), lazy(&x, 0).f_linear(&w, bias_t), micro, Split::Exact)?;
    }

    #[test]
    fn conv2d_every_parameter(
        n in 1i64..4,
        (groups, cin_per, cout_per) in (1i64..3, 1i64..3, 1i64..3),
        (h, w) in (1i64..9, 1i64..9),
        (kh, kw) in (1i64..4, 1i64..4),
        stride in prop::collection::vec(1i64..4, 1..=2),
        padding in prop::collection::vec(0i64..3, 1..=2),
        dilation in prop::collection::vec(1i64..3, 1..=2),
        bias in any::<bool>(),
        micro in 1usize..4,
    ) {
        let x = randn(&[n, groups * cin_per, h, w]);
        let wt = randn(&[groups * cout_per, cin_per, kh, kw]);
        let b = randn(&[groups * cout_per]);
        let bias_t = bias.then_some(&b);
        let eager = x.f_conv2d(&wt, bias_t, stride.as_slice(), padding.as_slice(), dilation.as_slice(), groups);
        let lazy_t = lazy(&x, 0).f_conv2d(&wt, bias_t, &stride, &padding, &dilation, groups);
        agree(&format!("conv2d s{stride:?} p{padding:?} d{dilation:?} g{groups} k{kh}x{kw} in {h}x{w}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn conv1d_every_parameter(
        n in 1i64..4,
        batched in any::<bool>(),
        (groups, cin_per, cout_per) in (1i64..3, 1i64..3, 1i64..3),
        len in 1i64..10,
        k in 1i64..4,
        stride in prop::collection::vec(1i64..4, 1..=2),
        padding in 0i64..3,
        dilation in 1i64..3,
        bias in any::<bool>(),
        micro in 1usize..4,
    ) {
        // A 2-element stride is refused by both, as libtorch refuses it.
        let shape: Vec<i64> = if batched { vec![n, groups * cin_per, len] } else { vec![groups * cin_per, len] };
        let x = randn(&shape);
        let wt = randn(&[groups * cout_per, cin_per, k]);
        let b = randn(&[groups * cout_per]);
        let bias_t = bias.then_some(&b);
        let eager = x.f_conv1d(&wt, bias_t, stride.as_slice(), [padding].as_slice(), [dilation].as_slice(), groups);
        let lazy_t = if batched {
            lazy(&x, 0).f_conv1d(&wt, bias_t, &stride, [padding], [dilation], groups)
        } else {
            LazyTensor::fixed(&x).f_conv1d(&wt, bias_t, &stride, [padding], [dilation], groups)
        };
        agree(&format!("conv1d {shape:?} s{stride:?} p{padding} d{dilation} g{groups} k{k}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn baddbmm_wherever_the_batch_is(
        case in 0usize..5,
        n in 1i64..5,
        (r, k, c) in (1i64..4, 1i64..4, 1i64..4),
        (beta, alpha) in (prop_oneof![Just(1.0f64), Just(0.0), -2.0f64..2.0], -2.0f64..2.0),
        input_shape in 0usize..3,
        micro in 1usize..5,
    ) {
        // The product's B is the batch (0), rows of batch1 (1), columns of batch2 (2), the
        // contracted dimension (3: mixes samples), or B with a fixed factor (4).
        let (b1, b2) = match case {
            1 => (randn(&[2, n, k]), randn(&[2, k, c])),
            2 => (randn(&[2, r, k]), randn(&[2, k, n])),
            3 => (randn(&[2, r, n]), randn(&[2, n, c])),
            _ => (randn(&[n, r, k]), randn(&[n, k, c])),
        };
        let out = vec![b1.size()[0], b1.size()[1], b2.size()[2]];
        // A fixed input broadcasts over the batch (size 1 there).
        let fixed_shape = |mut shape: Vec<i64>| {
            let at = shape.len() as i64 - 3 + [0, 1, 2][case.min(2)];
            if case < 3 && at >= 0 {
                shape[at as usize] = 1;
            }
            shape
        };
        let input = match input_shape {
            0 => randn(&out),
            1 => randn(&fixed_shape(out[1..].to_vec())),
            _ => randn(&fixed_shape(vec![1, 1, out[2]])),
        };
        let eager = input.f_baddbmm(&b1, &b2, beta, alpha);
        let (l1, l2) = match case {
            0 => (lazy(&b1, 0), lazy(&b2, 0)),
            1 => (lazy(&b1, 1), LazyTensor::fixed(&b2)),
            2 => (LazyTensor::fixed(&b1), lazy(&b2, 2)),
            3 => (lazy(&b1, 2), lazy(&b2, 1)),
            _ => (lazy(&b1, 0), LazyTensor::fixed(&b2)),
        };
        // An input with the whole output's shape carries the batch too.
        let li = if input_shape == 0 && case < 3 {
            lazy(&input, [0, 1, 2][case])
        } else {
            LazyTensor::fixed(&input)
        };
        let lazy_t = li.f_baddbmm(&l1, &l2, beta, alpha);
        let split = if case == 3 { Split::Refused } else { Split::Exact };
        if case == 4 && n > 1 {
            // A fixed factor with the batch's size along B is refused: it is per-sample data.
            prop_assert!(lazy_t.is_err());
            return Ok(());
        }
        agree(&format!("baddbmm case {case} input {:?} b1 {:?} b2 {:?}", input.size(), b1.size(), b2.size()), eager, lazy_t, micro, split)?;
    }

    #[test]
    fn scaled_dot_product_attention_every_option(
        case in 0usize..4,
        n in 1i64..4,
        (h, l, s, e) in (1i64..3, 1i64..5, 1i64..5, 1i64..4),
        mask in 0usize..3,
        causal in any::<bool>(),
        scale in prop_oneof![Just(None), (0.1f64..2.0).prop_map(Some)],
        gqa in any::<bool>(),
        micro in 1usize..4,
    ) {
        // 4-D (the fused kernel on the CPU), 3-D (the composite path), keys and values fixed
        // with the batch on the queries' rows, grouped-query heads.
        let (qs, ks): (Vec<i64>, Vec<i64>) = match case {
            0 => (vec![n, h, l, e], vec![n, h, s, e]),
            1 => (vec![n, l, e], vec![n, s, e]),
            2 => (vec![h, n, e], vec![h, s, e]),
            _ => (vec![n, 2 * h, l, e], vec![n, h, s, e]),
        };
        let (q, k, v) = (randn(&qs), randn(&ks), randn(&ks));
        let rows = qs[qs.len() - 2];
        // A fixed mask over the batch's rows would be per-sample data: only without that.
        let mask = if case == 2 && n > 1 { 0 } else { mask };
        let m = match mask {
            0 => None,
            1 => Some(Tensor::randint(2, [rows, s], (Kind::Int64, CPU)).to_kind(Kind::Bool).logical_or(&Tensor::eye_m(rows, s, (Kind::Bool, CPU)))),
            _ => Some(randn(&[rows, s])),
        };
        let gqa = gqa || case == 3;
        let eager = Tensor::f_scaled_dot_product_attention(&q, &k, &v, m.as_ref(), 0.0, causal, scale, gqa);
        let (lq, lk, lv) = if case == 2 {
            (lazy(&q, 1), LazyTensor::fixed(&k), LazyTensor::fixed(&v))
        } else {
            let (lq, lk) = lazy((&q, &k), 0);
            (lq, lk, lazy(&v, 0))
        };
        let lazy_t = LazyTensor::f_scaled_dot_product_attention(&lq, &lk, &lv, m.as_ref(), 0.0, causal, scale, gqa);
        let split = if case == 2 && causal { Split::Refused } else { Split::Exact };
        agree(&format!("sdpa case {case} q {qs:?} k {ks:?} mask {mask} causal {causal} gqa {gqa}"), eager, lazy_t, micro, split)?;
        // Dropout: each micro-batch draws its own; shapes only.
        let dropped = LazyTensor::f_scaled_dot_product_attention(&lq, &lk, &lv, m.as_ref(), 0.5, causal, scale, gqa);
        let eager_dropped = Tensor::f_scaled_dot_product_attention(&q, &k, &v, m.as_ref(), 0.5, causal, scale, gqa);
        agree("sdpa with dropout", eager_dropped, dropped, micro, Split::Shape)?;
    }

    #[test]
    fn masks_where_and_triangles(a in shape(4, 4), micro in 1usize..5, value in -3.0f64..3.0, diagonal in -2i64..3, fixed_mask in any::<bool>()) {
        let t = randn(&a);
        let l = lazy(&t, 0);
        // A mask over the trailing dimensions (fixed), or one per sample.
        let trailing: Vec<i64> = if fixed_mask { a[1..].to_vec() } else { a.clone() };
        let mask = Tensor::randint(2, trailing.as_slice(), (Kind::Int64, CPU)).to_kind(Kind::Bool);
        let lm = if fixed_mask { LazyTensor::fixed(&mask) } else { lazy(&mask, 0) };
        agree("masked_fill", t.f_masked_fill(&mask, value), l.f_masked_fill(&lm, value), micro, Split::Exact)?;
        let other = randn(&a);
        agree("where_self", t.f_where_self(&mask, &other), l.f_where_self(&lm, &lazy(&other, 0)), micro, Split::Exact)?;
        // libtorch refuses an integer mask (tch's `f_masked_fill` panics on it): so does recording.
        let not_bool = mask.to_kind(Kind::Int64);
        prop_assert!(l.f_masked_fill(&LazyTensor::fixed(&not_bool), value).is_err());
        // Triangles of the trailing two dimensions: the batch (dimension 0) stays per-sample
        // when it is not one of them.
        let split = if a.len() <= 2 { Split::Refused } else { Split::Exact };
        agree("tril", t.f_tril(diagonal), l.f_tril(diagonal), micro, split)?;
        agree("triu", t.f_triu(diagonal), l.f_triu(diagonal), micro, split)?;
    }

    #[test]
    fn bmm_wherever_the_batch_is(case in 0usize..4, n in 1i64..5, (r, k, c) in (1i64..4, 1i64..4, 1i64..4), micro in 1usize..5) {
        let (a, b) = match case {
            1 => (randn(&[2, n, k]), randn(&[2, k, c])),
            2 => (randn(&[2, r, k]), randn(&[2, k, n])),
            3 => (randn(&[2, r, n]), randn(&[2, n, c])),
            _ => (randn(&[n, r, k]), randn(&[n, k, c])),
        };
        let (la, lb) = match case {
            0 => (lazy(&a, 0), lazy(&b, 0)),
            1 => (lazy(&a, 1), LazyTensor::fixed(&b)),
            2 => (LazyTensor::fixed(&a), lazy(&b, 2)),
            _ => (lazy(&a, 2), lazy(&b, 1)),
        };
        let split = if case == 3 { Split::Refused } else { Split::Exact };
        agree(&format!("bmm case {case}"), a.f_bmm(&b), la.f_bmm(&lb), micro, split)?;
    }

    #[test]
    fn chunks_and_splits_are_tchs(a in shape(3, 7), pieces in 1i64..5, dim in 1usize..3, micro in 1usize..4) {
        let t = randn(&a);
        let l = lazy(&t, 0);
        let dim = dim.min(a.len() - 1) as i64;
        if dim == 0 {
            return Ok(());
        }
        let eager = t.chunk(pieces, dim);
        let lazy_parts = l.f_chunk(pieces, dim).unwrap();
        prop_assert_eq!(eager.len(), lazy_parts.len(), "chunk count");
        for (e, p) in eager.into_iter().zip(lazy_parts) {
            agree("chunk", Ok(e), Ok(p), micro, Split::Exact)?;
        }
        let eager = t.split(pieces, dim);
        let lazy_parts = l.f_split(pieces, dim).unwrap();
        prop_assert_eq!(eager.len(), lazy_parts.len(), "split count");
        for (e, p) in eager.into_iter().zip(lazy_parts) {
            agree("split", Ok(e), Ok(p), micro, Split::Exact)?;
        }
    }

    #[test]
    fn expand_repeat_index_select_and_pad(a in shape(3, 4), micro in 1usize..4, new_dims in 0usize..2, r in 1i64..3, pad in prop::collection::vec(0i64..3, 2..=4), mode in 0usize..4) {
        let t = randn(&a);
        let l = lazy(&t, 0);
        // Expand: size-1 dimensions grow, leading ones are added.
        let ones = Tensor::randn([a[0], 1], F64);
        let target: Vec<i64> = [vec![2; new_dims], vec![a[0], 3]].concat();
        agree("expand", ones.f_expand(target.as_slice(), false), lazy(&ones, 0).f_expand(&target, false), micro, Split::Exact)?;
        agree("expand, bad", t.f_expand([a[0] + 1].as_slice(), false), l.f_expand([a[0] + 1], false), micro, Split::Exact)?;
        // Repeat: along the other dimensions only (along the batch it mixes samples).
        let mut repeats = vec![1; a.len()];
        if a.len() > 1 {
            repeats[a.len() - 1] = r;
        }
        agree("repeat", t.f_repeat(repeats.as_slice()), l.f_repeat(&repeats), micro, Split::Exact)?;
        let mut along_batch = vec![1; a.len()];
        along_batch[0] = 2;
        agree("repeat along the batch", t.f_repeat(along_batch.as_slice()), l.f_repeat(&along_batch), micro, Split::Refused)?;
        // Index select along the last dimension (fixed index), and along the batch (mixes).
        let last = a.len() as i64 - 1;
        let index = Tensor::randint(a[a.len() - 1], [3], (Kind::Int64, CPU));
        let split = if last == 0 { Split::Refused } else { Split::Exact };
        agree("index_select", t.f_index_select(last, &index), l.f_index_select(last, &index), micro, split)?;
        // Gather along the last dimension with an index split with the batch, and with a fixed
        // index (it would pair every micro-batch with the first samples' indices: mixes).
        let mut ishape = a.clone();
        ishape[a.len() - 1] = r + 1;
        let gidx = Tensor::randint(a[a.len() - 1], ishape.as_slice(), (Kind::Int64, CPU));
        if last > 0 {
            agree("gather", t.f_gather(last, &gidx, false), l.f_gather(last, &lazy(&gidx, 0), false), micro, Split::Exact)?;
        }
        agree("gather, fixed index", t.f_gather(last, &gidx, false), l.f_gather(last, &gidx, false), micro, Split::Refused)?;
        agree("gather, bad kind", t.f_gather(last, &gidx.to_kind(Kind::Float), false), l.f_gather(last, &lazy(&gidx.to_kind(Kind::Float), 0), false), micro, Split::Exact)?;
        // Select an entry of the last dimension (and of the batch: mixes), negative ones too.
        let pick = -(r.min(a[a.len() - 1]));
        agree("select", t.f_select(last, pick), l.f_select(last, pick), micro, if last == 0 { Split::Refused } else { Split::Exact })?;
        agree("select out of range", t.f_select(last, a[a.len() - 1]), l.f_select(last, a[a.len() - 1]), micro, Split::Exact)?;
        // Pad the trailing dimensions.
        let pad = if pad.len() % 2 == 1 { pad[..pad.len() - 1].to_vec() } else { pad };
        let mode = ["constant", "reflect", "replicate", "circular"][mode];
        let value = (mode == "constant").then_some(1.5);
        let batched4 = Tensor::randn([a[0], 2, 3, 4], F64);
        agree(&format!("pad {mode} {pad:?}"), batched4.f_pad(pad.as_slice(), mode, value), lazy(&batched4, 0).f_pad(&pad, mode, value), micro, Split::Exact)?;
    }

    #[test]
    fn group_norm_and_upsampling(n in 1i64..5, groups in 1i64..4, per in 1i64..3, (h, w) in (1i64..6, 1i64..6), (oh, ow) in (1i64..9, 1i64..9), affine in any::<bool>(), micro in 1usize..4) {
        let c = groups * per;
        let x = randn(&[n, c, h, w]);
        let (wt, b) = (randn(&[c]), randn(&[c]));
        let (wo, bo) = if affine { (Some(&wt), Some(&b)) } else { (None, None) };
        agree("group_norm", x.f_group_norm(groups, wo, bo, 1e-5, true), lazy(&x, 0).f_group_norm(groups, wo, bo, 1e-5, true), micro, Split::Exact)?;
        agree("group_norm, bad groups", x.f_group_norm(c + 1, wo, bo, 1e-5, true), lazy(&x, 0).f_group_norm(c + 1, wo, bo, 1e-5, true), micro, Split::Exact)?;
        agree("upsample_nearest2d", x.f_upsample_nearest2d([oh, ow].as_slice(), None, None), lazy(&x, 0).f_upsample_nearest2d([oh, ow], None, None), micro, Split::Exact)?;
        // Bilinear upsampling, with and without aligned corners and scales.
        let scale = (affine && per == 1).then_some(oh as f64 / h as f64);
        agree("upsample_bilinear2d", x.f_upsample_bilinear2d([oh, ow].as_slice(), affine, scale, None), lazy(&x, 0).f_upsample_bilinear2d([oh, ow], affine, scale, None), micro, Split::Exact)?;
        // The dropouts: the value itself in eval mode; in training, random masks (shapes only).
        let lx = lazy(&x, 0);
        agree("dropout eval", x.f_dropout(0.3, false), lx.f_dropout(0.3, false), micro, Split::Exact)?;
        agree("feature_dropout eval", x.f_feature_dropout(0.3, false), lx.f_feature_dropout(0.3, false), micro, Split::Exact)?;
        agree("alpha_dropout eval", x.f_alpha_dropout(0.3, false), lx.f_alpha_dropout(0.3, false), micro, Split::Exact)?;
        agree("feature_alpha_dropout eval", x.f_feature_alpha_dropout(0.3, false), lx.f_feature_alpha_dropout(0.3, false), micro, Split::Exact)?;
        agree("feature_dropout train", x.f_feature_dropout(0.3, true), lx.f_feature_dropout(0.3, true), micro, Split::Shape)?;
        agree("alpha_dropout train", x.f_alpha_dropout(0.3, true), lx.f_alpha_dropout(0.3, true), micro, Split::Shape)?;
        agree("feature_alpha_dropout train", x.f_feature_alpha_dropout(0.3, true), lx.f_feature_alpha_dropout(0.3, true), micro, Split::Shape)?;
        let flat = randn(&[n]);
        agree("feature_dropout 1-D", flat.f_feature_dropout(0.3, true), lazy(&flat, 0).f_feature_dropout(0.3, true), micro, Split::Shape)?;
        // RMS norm over the trailing one or two dimensions, with or without a weight and eps.
        let trailing: Vec<i64> = if affine { vec![w] } else { vec![h, w] };
        let rw = randn(&trailing);
        let eps = if affine { Some(1e-6) } else { None };
        agree("rms_norm", x.f_rms_norm(trailing.as_slice(), affine.then_some(&rw), eps), lazy(&x, 0).f_rms_norm(&trailing, affine.then_some(&rw), eps), micro, Split::Exact)?;
        agree("rms_norm, bad shape", x.f_rms_norm([w + 1].as_slice(), None::<&Tensor>, eps), lazy(&x, 0).f_rms_norm([w + 1], None::<&Tensor>, eps), micro, Split::Exact)?;
    }

    #[test]
    fn conv_transpose2d_every_parameter(
        (n, groups, cin_per, cout_per) in (1i64..4, 1i64..3, 1i64..3, 1i64..3),
        (h, w) in (1i64..6, 1i64..6),
        (kh, kw) in (1i64..4, 1i64..4),
        (stride, padding, dilation, extra) in (1i64..3, 0i64..2, 1i64..3, 0i64..2),
        bias in any::<bool>(),
        micro in 1usize..4,
    ) {
        let x = randn(&[n, groups * cin_per, h, w]);
        let weight = randn(&[groups * cin_per, cout_per, kh, kw]);
        let b = randn(&[groups * cout_per]);
        let bo = bias.then_some(&b);
        // output_padding must stay below the stride or the dilation: libtorch refuses it otherwise.
        let op = extra.min(stride.max(dilation) - 1);
        let eager = x.f_conv_transpose2d(&weight, bo, [stride].as_slice(), [padding].as_slice(), [op].as_slice(), groups, [dilation].as_slice());
        let lazy_t = lazy(&x, 0).f_conv_transpose2d(&weight, bo, [stride], [padding], [op], groups, [dilation]);
        agree(&format!("conv_transpose2d s{stride} p{padding} op{op} d{dilation} g{groups}"), eager, lazy_t, micro, Split::Exact)?;
        // An output padding as large as the stride is refused by both.
        let bad = x.f_conv_transpose2d(&weight, bo, [1].as_slice(), [0].as_slice(), [1].as_slice(), groups, [1].as_slice());
        agree("conv_transpose2d, bad output padding", bad, lazy(&x, 0).f_conv_transpose2d(&weight, bo, [1], [0], [1], groups, [1]), micro, Split::Exact)?;
    }

    #[test]
    fn max_pool2d_every_parameter(
        shape in (1i64..4, 1i64..3, 1i64..10, 1i64..10),
        kernel in prop::collection::vec(1i64..4, 1..=2),
        stride in prop::collection::vec(1i64..4, 0..=2),
        padding in prop::collection::vec(0i64..3, 1..=2),
        dilation in prop::collection::vec(1i64..3, 1..=2),
        ceil_mode in any::<bool>(),
        micro in 1usize..4,
    ) {
        let x = randn(&[shape.0, shape.1, shape.2, shape.3]);
        let eager = x.f_max_pool2d(kernel.as_slice(), stride.as_slice(), padding.as_slice(), dilation.as_slice(), ceil_mode);
        let lazy_t = lazy(&x, 0).f_max_pool2d(&kernel, &stride, &padding, &dilation, ceil_mode);
        agree(&format!("max_pool2d {shape:?} k{kernel:?} s{stride:?} p{padding:?} d{dilation:?} ceil {ceil_mode}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn avg_pool2d_every_parameter(
        shape in (1i64..4, 1i64..3, 1i64..10, 1i64..10),
        kernel in prop::collection::vec(1i64..4, 1..=2),
        stride in prop::collection::vec(1i64..4, 0..=2),
        padding in prop::collection::vec(0i64..3, 1..=2),
        ceil_mode in any::<bool>(),
        count_include_pad in any::<bool>(),
        divisor in prop::option::of(1i64..5),
        micro in 1usize..4,
        unbatched in any::<bool>(),
    ) {
        let x = randn(&[shape.0, shape.1, shape.2, shape.3]);
        // A 3-D input [C, H, W] with the batch along C also splits: pooling is per channel.
        let x = if unbatched { x.select(0, 0) } else { x };
        let eager = x.f_avg_pool2d(kernel.as_slice(), stride.as_slice(), padding.as_slice(), ceil_mode, count_include_pad, divisor);
        let lazy_t = lazy(&x, 0).f_avg_pool2d(&kernel, &stride, &padding, ceil_mode, count_include_pad, divisor);
        agree(&format!("avg_pool2d {:?} k{kernel:?} s{stride:?} p{padding:?} ceil {ceil_mode}", x.size()), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn adaptive_avg_pool2d_sizes(shape in (1i64..4, 1i64..3, 1i64..9, 1i64..9), out in prop::collection::vec(1i64..6, 2..=2), micro in 1usize..4) {
        let x = randn(&[shape.0, shape.1, shape.2, shape.3]);
        agree("adaptive_avg_pool2d", x.f_adaptive_avg_pool2d(out.as_slice()), lazy(&x, 0).f_adaptive_avg_pool2d(&out), micro, Split::Exact)?;
    }

    #[test]
    fn normalization_dropout_embedding(
        n in 1i64..5,
        c in 1i64..4,
        hw in prop::collection::vec(1i64..4, 0..=2),
        micro in 1usize..5,
        affine in any::<bool>(),
        last in 1usize..3,
    ) {
        let shape = [&[n, c][..], &hw[..]].concat();
        let x = randn(&shape);
        let (w, b, rm, rv) = (randn(&[c]), randn(&[c]), randn(&[c]), randn(&[c]).abs() + 0.1);
        let (wo, bo) = (affine.then_some(&w), affine.then_some(&b));
        let eager = Tensor::f_batch_norm(&x, wo, bo, Some(&rm), Some(&rv), false, 0.1, 1e-5, true);
        agree("batch_norm eval", eager, lazy(&x, 0).f_batch_norm(wo, bo, &rm, &rv, false, 0.1, 1e-5), micro, Split::Exact)?;

        let norm: Vec<i64> = shape[shape.len() - last.min(shape.len() - 1)..].to_vec();
        let (lw, lb) = (randn(&norm), randn(&norm));
        let (lwo, lbo) = (affine.then_some(&lw), affine.then_some(&lb));
        let eager = x.f_layer_norm(norm.as_slice(), lwo, lbo, 1e-5, true);
        agree(&format!("layer_norm {shape:?} over {norm:?}"), eager, lazy(&x, 0).f_layer_norm(&norm, lwo, lbo, 1e-5, true), micro, Split::Exact)?;

        agree("dropout eval", x.f_dropout(0.5, false), lazy(&x, 0).f_dropout(0.5, false), micro, Split::Exact)?;
        agree("dropout p=0", x.f_dropout(0.0, true), lazy(&x, 0).f_dropout(0.0, true), micro, Split::Exact)?;
        agree("dropout train", x.f_dropout(0.5, true), lazy(&x, 0).f_dropout(0.5, true), micro, Split::Shape)?;

        let table = randn(&[7, c]);
        let idx = Tensor::randint(7, shape.as_slice(), (Kind::Int64, CPU));
        let eager = Tensor::f_embedding(&table, &idx, -1, false, false);
        agree("embedding", eager, LazyTensor::f_embedding(&table, &lazy(&idx, 0), -1, false, false), micro, Split::Exact)?;
    }

    #[test]
    fn shape_ops_follow_the_batch(
        a in shape(4, 4),
        ops in prop::collection::vec((0usize..8, -4i64..4, -4i64..4), 1..4),
        micro in 1usize..5,
    ) {
        let t = randn(&a);
        let mut e = t.shallow_clone();
        let mut l = lazy(&t, 0);
        let mut split = Split::Exact;
        for (op, d0, d1) in ops {
            let nd = e.dim() as i64;
            let wrap = |d: i64| d.rem_euclid(nd.max(1));
            let (eager, lazy_t) = match op {
                0 => (e.f_transpose(d0, d1), l.f_transpose(d0, d1)),
                1 => {
                    let mut perm: Vec<i64> = (0..nd).collect();
                    perm.rotate_left(wrap(d0) as usize);
                    (e.f_permute(perm.as_slice()), l.f_permute(&perm))
                }
                2 => (e.f_unsqueeze(d0), l.f_unsqueeze(d0)),
                3 => (e.f_squeeze_dims(&[d0][..]), l.f_squeeze_dim(d0)),
                4 => (e.f_flatten(d0.min(d1), d0.max(d1)), l.f_flatten(d0.min(d1), d0.max(d1))),
                5 => {
                    // Merge the first two dims, or split the first one in two.
                    let s = e.size();
                    let target: Vec<i64> = match s.len() {
                        0 => vec![1],
                        1 => vec![s[0], 1],
                        _ => [&[s[0] * s[1]][..], &s[2..]].concat(),
                    };
                    (e.f_reshape(target.as_slice()), l.f_reshape(&target))
                }
                6 => (e.f_contiguous(), l.f_contiguous()),
                _ => {
                    let s = e.size();
                    let d = wrap(d0);
                    let len = s.get(d as usize).copied().unwrap_or(1);
                    (e.f_narrow(d, len / 2, len - len / 2), l.f_narrow(d, len / 2, len - len / 2))
                }
            };
            match (eager, lazy_t) {
                (Ok(e2), Ok(l2)) => {
                    prop_assert_eq!(l2.size(), e2.size());
                    if l2.batch_dim().is_none() && t.size()[0] > 1 {
                        split = Split::Refused;
                    }
                    e = e2;
                    l = l2;
                }
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "op {op} ({d0}, {d1}) on {:?}: tch {:?}, lazy {:?}", e.size(), a.map(|t| t.size()), b.map(|t| t.size())),
            }
        }
        agree("shape ops", Ok(e), Ok(l), micro, split)?;
    }

    #[test]
    fn views_merge_and_split_the_batch(n in 1i64..6, t in 1i64..4, c in 1i64..4, micro in 1usize..6) {
        let x = randn(&[n, t, c]);
        let l = lazy(&x, 0);
        let merged = l.view([-1, c]);
        prop_assert_eq!(merged.batch_dim(), Some(0));
        agree("view merge", x.f_view([-1, c]), Ok(merged.clone()), micro, Split::Exact)?;
        agree("view split", x.f_view([-1, c]).and_then(|m| m.f_view([n, t, c])), merged.f_view([n, t, c]), micro, Split::Exact)?;
        // [N, T, C] -> [T, N, C] -> [T * N, C] puts samples of several positions in each row block.
        let moved = l.transpose(0, 1).reshape([-1, c]);
        agree("moved", x.transpose(0, 1).f_reshape([-1, c]), Ok(moved), micro, if n > 1 && t > 1 { Split::Refused } else { Split::Exact })?;
        let cat_e = Tensor::f_cat(&[&x, &(&x * 2.0)], 2);
        let cat_l = LazyTensor::f_cat(&[l.clone(), &l * 2.0], 2);
        agree("cat", cat_e, cat_l, micro, Split::Exact)?;
        let cat_batch = LazyTensor::f_cat(&[l.clone(), l.clone()], 0);
        agree("cat batch", Tensor::f_cat(&[&x, &x], 0), cat_batch, micro, Split::Refused)?;
        let to_kind = l.f_to_kind(Kind::Float);
        agree("to_kind", x.f_to_kind(Kind::Float), to_kind, micro, Split::Exact)?;
    }

    #[test]
    fn reductions_over_any_dims(a in shape(4, 4), dims in prop::collection::vec(-4i64..4, 0..3), keepdim in any::<bool>(), op in 0usize..6, micro in 1usize..5) {
        let t = randn(&a);
        let l = lazy(&t, 0);
        let (eager, lazy_t, name) = match op {
            0 => (t.f_sum_dim_intlist(dims.as_slice(), keepdim, None), l.f_sum_dim_intlist(&dims, keepdim, None), "sum"),
            1 => (t.f_mean_dim(dims.as_slice(), keepdim, None), l.f_mean_dim(&dims, keepdim, None), "mean"),
            2 => (t.f_amax(dims.as_slice(), keepdim), l.f_amax(&dims, keepdim), "amax"),
            3 => (t.f_sum(Kind::Float), l.f_sum(Kind::Float), "sum all"),
            4 => (t.f_mean(None), l.f_mean(None), "mean all"),
            _ => (t.f_max(), l.f_max(), "max all"),
        };
        agree(&format!("{name} {a:?} dims {dims:?} keepdim {keepdim}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn logsumexp_over_any_dims(a in shape(4, 4), dims in prop::collection::vec(-4i64..4, 1..3), keepdim in any::<bool>(), micro in 1usize..5) {
        let t = randn(&a);
        // Over the batch dimension it mixes samples: evaluated whole, refused when split.
        let rank = a.len() as i64;
        let over_batch = dims.iter().any(|&d| d.rem_euclid(rank.max(1)) == 0 && d >= -rank && d < rank);
        let split = if over_batch { Split::Refused } else { Split::Exact };
        agree(
            &format!("logsumexp {a:?} dims {dims:?} keepdim {keepdim}"),
            t.f_logsumexp(dims.as_slice(), keepdim),
            lazy(&t, 0).f_logsumexp(&dims, keepdim),
            micro,
            split,
        )?;
    }

    #[test]
    fn glu_along_any_dim(a in shape(4, 4), dim in -5i64..5, scalar in any::<bool>(), micro in 1usize..5) {
        // Doubled sizes, so that most dimensions can be halved (a 1 stays odd: refused).
        let a: Vec<i64> = a.iter().map(|&s| if s == 1 { 1 } else { 2 * s }).collect();
        let t = if scalar { randn(&a).sum(Kind::Float) } else { randn(&a) };
        let rank = t.dim() as i64;
        let split = if dim.rem_euclid(rank.max(1)) == 0 { Split::Refused } else { Split::Exact };
        let l = if scalar { toma::lazy::LazyTensor::fixed(&t) } else { lazy(&t, 0) };
        agree(&format!("glu {a:?} dim {dim} scalar {scalar}"), t.f_glu(dim), l.f_glu(dim), micro, split)?;
    }

    #[test]
    fn var_and_std_over_any_dims(
        a in shape(4, 4),
        dims in prop::option::of(prop::collection::vec(-4i64..4, 0..3)),
        unbiased in any::<bool>(),
        keepdim in any::<bool>(),
        sqrt in any::<bool>(),
        micro in 1usize..5,
    ) {
        // Two entries or more along each dimension: Bessel's correction over one entry divides
        // by zero (NaN, and a warning from libtorch at every call).
        let a: Vec<i64> = a.iter().map(|&s| s + 1).collect();
        let t = randn(&a);
        // Over the batch dimension (or all) they mix samples: evaluated whole, refused when split.
        let rank = a.len() as i64;
        let over_batch = match &dims {
            None => true,
            Some(d) if d.is_empty() => true,
            Some(d) => d.iter().any(|&d| d.rem_euclid(rank.max(1)) == 0 && d >= -rank && d < rank),
        };
        let split = if over_batch { Split::Refused } else { Split::Exact };
        let (eager, lazy_t) = match (&dims, sqrt) {
            (None, false) => (t.f_var(unbiased), lazy(&t, 0).f_var(unbiased)),
            (None, true) => (t.f_std(unbiased), lazy(&t, 0).f_std(unbiased)),
            (Some(d), false) => (t.f_var_dim(d.as_slice(), unbiased, keepdim), lazy(&t, 0).f_var_dim(d, unbiased, keepdim)),
            (Some(d), true) => (t.f_std_dim(d.as_slice(), unbiased, keepdim), lazy(&t, 0).f_std_dim(d, unbiased, keepdim)),
        };
        agree(&format!("var/std {a:?} dims {dims:?} unbiased {unbiased} keepdim {keepdim} sqrt {sqrt}"), eager, lazy_t, micro, split)?;
    }

    #[test]
    fn cosine_similarity_broadcasting_along_any_dim(
        (a, b) in shape(4, 4).prop_flat_map(|a| broadcast_partner(a, true)),
        both in any::<bool>(),
        dim in -4i64..4,
        eps in prop::sample::select(vec![1e-8, 1e-3, 1.0]),
        micro in 1usize..5,
    ) {
        let (ta, tb) = (randn(&a), randn(&b));
        let tb = if both && b.len() == a.len() { randn(&[&a[..1], &b[1..]].concat()) } else { tb };
        let la = lazy(&ta, 0);
        let lb = if both && tb.dim() == ta.dim() { lazy(&tb, 0) } else { LazyTensor::fixed(&tb) };
        // Along the batch dimension (0 of the broadcast shape) it mixes samples.
        let rank = a.len().max(b.len()) as i64;
        let split = if dim.rem_euclid(rank) == 0 && dim >= -rank && dim < rank { Split::Refused } else { Split::Exact };
        agree(
            &format!("cosine_similarity {a:?} {b:?} dim {dim} eps {eps}"),
            Tensor::f_cosine_similarity(&ta, &tb, dim, eps),
            la.f_cosine_similarity(&lb, dim, eps),
            micro,
            split,
        )?;
    }

    #[test]
    fn stack_at_any_dim(a in shape(3, 4), k in 1usize..4, dim in -4i64..4, fixed in any::<bool>(), micro in 1usize..5) {
        let ts: Vec<Tensor> = (0..k).map(|_| randn(&a)).collect();
        let rank = a.len() as i64 + 1;
        let lz: Vec<LazyTensor> = ts.iter().enumerate().map(|(i, t)| if fixed && i > 0 { LazyTensor::fixed(t) } else { lazy(t, 0) }).collect();
        // Stacked at 0 the batch moves to dimension 1: still per sample. A fixed operand with the
        // batch's size along it is refused, as for `cat`.
        let eager = Tensor::f_stack(&ts, dim);
        let lazily = LazyTensor::f_stack(&lz, dim);
        if fixed && k > 1 && a[0] > 1 {
            prop_assert!(lazily.is_err() || dim < -rank || dim >= rank, "stack {a:?} x{k} at {dim}: a fixed operand with the batch's size must be refused");
        } else {
            agree(&format!("stack {a:?} x{k} at {dim}"), eager, lazily, micro, Split::Exact)?;
        }
    }

    #[test]
    fn argmax_and_argmin(a in shape(4, 4), dim in prop::option::of(-4i64..4), keepdim in any::<bool>(), max in any::<bool>(), micro in 1usize..5) {
        let t = randn(&a);
        let rank = a.len() as i64;
        // Per sample unless it compares along the batch dimension (0) or over everything.
        let split = match dim {
            Some(d) if d >= -rank && d < rank && d.rem_euclid(rank) != 0 => Split::Exact,
            _ => Split::Refused,
        };
        let (eager, lazily) = if max {
            (t.f_argmax(dim, keepdim), lazy(&t, 0).f_argmax(dim, keepdim))
        } else {
            (t.f_argmin(dim, keepdim), lazy(&t, 0).f_argmin(dim, keepdim))
        };
        agree(&format!("arg{} {a:?} dim {dim:?} keepdim {keepdim}", if max { "max" } else { "min" }), eager, lazily, micro, split)?;
    }

    #[test]
    fn min_and_amin(a in shape(4, 4), dims in prop::collection::vec(-4i64..4, 1..3), keepdim in any::<bool>(), micro in 1usize..5) {
        let t = randn(&a);
        // Over the batch it compares samples: a split is refused.
        agree(&format!("min {a:?}"), t.f_min(), lazy(&t, 0).f_min(), micro, Split::Refused)?;
        let rank = a.len() as i64;
        let over_batch = dims.iter().any(|&d| d >= -rank && d < rank && d.rem_euclid(rank) == 0);
        let split = if over_batch { Split::Refused } else { Split::Exact };
        agree(&format!("amin {a:?} {dims:?} {keepdim}"), t.f_amin(dims.as_slice(), keepdim), lazy(&t, 0).f_amin(&dims, keepdim), micro, split)?;
    }

    #[test]
    fn one_hot_rows(a in shape(3, 4), classes in 1i64..6, micro in 1usize..5) {
        let t = Tensor::randint(classes, a.as_slice(), (Kind::Int64, Device::Cpu));
        agree(&format!("one_hot {a:?} {classes}"), t.f_one_hot(classes), lazy(&t, 0).f_one_hot(classes), micro, Split::Exact)?;
        agree(&format!("onehot {a:?} {classes}"), Ok(t.onehot(classes)), lazy(&t, 0).f_onehot(classes), micro, Split::Exact)?;
    }

    #[test]
    fn pooling_in_one_dimension(n in 1i64..4, c in 1i64..3, l in 1i64..12, k in 1i64..4, st in 0i64..3, p in 0i64..2, ceil in any::<bool>(), micro in 1usize..5) {
        let t = randn(&[n, c, l]);
        let stride: Vec<i64> = if st == 0 { vec![] } else { vec![st] };
        agree(&format!("max_pool1d {l} k {k} s {stride:?} p {p} ceil {ceil}"),
            t.f_max_pool1d([k], stride.as_slice(), [p], [1], ceil),
            lazy(&t, 0).f_max_pool1d([k], stride.as_slice(), [p], [1], ceil), micro, Split::Exact)?;
        agree(&format!("avg_pool1d {l} k {k} s {stride:?} p {p} ceil {ceil}"),
            t.f_avg_pool1d([k], stride.as_slice(), [p], ceil, true),
            lazy(&t, 0).f_avg_pool1d([k], stride.as_slice(), [p], ceil, true), micro, Split::Exact)?;
        agree(&format!("adaptive_avg_pool1d {l} to {k}"),
            t.f_adaptive_avg_pool1d([k]), lazy(&t, 0).f_adaptive_avg_pool1d([k]), micro, Split::Exact)?;
    }

    #[test]
    fn cumsum_along_any_dim(a in shape(4, 4), dim in -4i64..4, micro in 1usize..5) {
        let t = randn(&a);
        let rank = a.len() as i64;
        let split = if dim >= -rank && dim < rank && dim.rem_euclid(rank) == 0 { Split::Refused } else { Split::Exact };
        agree(&format!("cumsum {a:?} dim {dim}"), t.f_cumsum(dim, None::<Kind>), lazy(&t, 0).f_cumsum(dim, None::<Kind>), micro, split)?;
    }

    #[test]
    fn roll_any_dims(a in shape(4, 4), pairs in prop::collection::vec((-5i64..5, -4i64..4), 0..3), micro in 1usize..5) {
        let t = randn(&a);
        let rank = a.len() as i64;
        let (shifts, dims): (Vec<i64>, Vec<i64>) = if pairs.is_empty() { (vec![2], vec![]) } else { pairs.into_iter().unzip() };
        let over_batch = dims.is_empty() || dims.iter().any(|&d| d >= -rank && d < rank && d.rem_euclid(rank) == 0);
        let split = if over_batch { Split::Refused } else { Split::Exact };
        agree(&format!("roll {a:?} {shifts:?} {dims:?}"), t.f_roll(shifts.as_slice(), dims.as_slice()), lazy(&t, 0).f_roll(&shifts, &dims), micro, split)?;
    }

    #[test]
    fn topk_values_and_positions(a in shape(4, 5), dim in -4i64..4, k in 0i64..4, largest in any::<bool>(), micro in 1usize..5) {
        let t = randn(&a);
        let rank = a.len() as i64;
        let split = if dim >= -rank && dim < rank && dim.rem_euclid(rank) == 0 { Split::Refused } else { Split::Exact };
        let eager = t.f_topk(k, dim, largest, true);
        let lazily = lazy(&t, 0).f_topk(k, dim, largest, true);
        let what = format!("topk {a:?} k {k} dim {dim} largest {largest}");
        match (eager, lazily) {
            (Ok((ev, ei)), Ok((lv, li))) => {
                agree(&what, Ok(ev), Ok(lv), micro, split)?;
                agree(&format!("{what} positions"), Ok(ei), Ok(li), micro, split)?;
            }
            (Err(_), Err(_)) => {}
            (e, l) => prop_assert!(false, "{what}: tch {:?}, lazy {:?}", e.is_ok(), l.is_ok()),
        }
    }

    #[test]
    fn cumprod_along_any_dim(a in shape(4, 4), dim in -4i64..4, micro in 1usize..5, zeros in any::<bool>(), int in any::<bool>()) {
        let t = if zeros { randn(&a).relu() } else { randn(&a) };
        let t = if int { Tensor::randint(3, a.as_slice(), (Kind::Int64, CPU)) } else { t };
        let rank = a.len() as i64;
        let split = if dim >= -rank && dim < rank && dim.rem_euclid(rank) == 0 { Split::Refused } else { Split::Exact };
        let what = format!("cumprod {a:?} dim {dim} int {int}");
        agree(&what, t.f_cumprod(dim, None::<Kind>), lazy(&t, 0).f_cumprod(dim, None::<Kind>), micro, split)?;
        agree(&format!("{what} as Double"), t.f_cumprod(dim, Kind::Double), lazy(&t, 0).f_cumprod(dim, Kind::Double), micro, split)?;
    }

    #[test]
    fn sort_values_and_positions(a in shape(4, 5), dim in -4i64..4, descending in any::<bool>(), stable in prop::option::of(any::<bool>()), ties in any::<bool>(), micro in 1usize..5) {
        // With ties, only a stable sort's positions are determined.
        let t = if ties { Tensor::randint(3, a.as_slice(), (Kind::Int64, CPU)).to_kind(Kind::Double) } else { randn(&a) };
        // Booleans sort too.
        let t = if ties && descending { t.gt(0.5) } else { t };
        let rank = a.len() as i64;
        let split = if dim >= -rank && dim < rank && dim.rem_euclid(rank) == 0 { Split::Refused } else { Split::Exact };
        let l = lazy(&t, 0);
        let (eager, lazily) = match stable {
            Some(stable) => (t.f_sort_stable(stable, dim, descending), l.f_sort_stable(stable, dim, descending)),
            None => (t.f_sort(dim, descending), l.f_sort(dim, descending)),
        };
        let what = format!("sort {a:?} dim {dim} descending {descending} stable {stable:?}");
        match (eager, lazily) {
            (Ok((ev, ei)), Ok((lv, li))) => {
                agree(&what, Ok(ev), Ok(lv), micro, split)?;
                if !ties || stable == Some(true) {
                    agree(&format!("{what} positions"), Ok(ei), Ok(li), micro, split)?;
                }
            }
            (Err(_), Err(_)) => {}
            (e, l) => prop_assert!(false, "{what}: tch {:?}, lazy {:?}", e.is_ok(), l.is_ok()),
        }
    }

    #[test]
    fn norms_and_normalize(a in shape(4, 4), d in 0i64..4, negative in any::<bool>(), keepdim in any::<bool>(), two in any::<bool>(), micro in 1usize..5) {
        let t = randn(&a);
        let p = if two { 2.0 } else { 1.0 };
        let rank = a.len() as i64;
        // tch panics (in its scalar conversion) on a dimension out of range: only valid ones.
        let dim = d % rank - if negative { rank } else { 0 };
        let over_batch = dim.rem_euclid(rank) == 0;
        let split = if over_batch { Split::Refused } else { Split::Exact };
        agree(&format!("norm {a:?}"), t.f_norm(), lazy(&t, 0).f_norm(), micro, Split::Refused)?;
        agree(&format!("norm p {p} {a:?} dim {dim} keepdim {keepdim}"), t.f_norm_scalaropt_dim(p, [dim], keepdim), lazy(&t, 0).f_norm_scalaropt_dim(p, [dim], keepdim), micro, split)?;
        let eager = t.f_norm_scalaropt_dim(p, [dim], true).and_then(|n| n.f_clamp_min(1e-12)).and_then(|n| t.f_div(&n.expand_as(&t)));
        agree(&format!("normalize p {p} {a:?} dim {dim}"), eager, lazy(&t, 0).f_normalize(p, dim, 1e-12), micro, split)?;
    }

    #[test]
    fn outer_of_vectors(n in 1i64..6, m in 1i64..6, micro in 1usize..5) {
        // A batch of scalars times a fixed vector: row `i` is sample `i`'s.
        let (a, b) = (randn(&[n]), randn(&[m]));
        agree(&format!("outer {n} {m}"), a.f_outer(&b), lazy(&a, 0).f_outer(&b), micro, Split::Exact)?;
    }

    #[test]
    fn flip_any_dims(a in shape(4, 4), dims in prop::collection::vec(-4i64..4, 0..3), micro in 1usize..5) {
        let t = randn(&a);
        let rank = a.len() as i64;
        let over_batch = dims.iter().any(|&d| d.rem_euclid(rank) == 0 && d >= -rank && d < rank);
        let split = if over_batch { Split::Refused } else { Split::Exact };
        agree(&format!("flip {a:?} dims {dims:?}"), t.f_flip(dims.as_slice()), lazy(&t, 0).f_flip(&dims), micro, split)?;
    }

    #[test]
    fn losses_every_reduction(n in 1i64..7, c in 1i64..5, micro in 1usize..7, reduction in 0usize..3, ignore in any::<bool>()) {
        let x = randn(&[n, c]);
        let y = Tensor::randint(c, [n], (Kind::Int64, CPU));
        if ignore && n > 1 {
            let _ = y.get(0).fill_(-100);
        }
        let red = [Reduction::Mean, Reduction::Sum, Reduction::None][reduction];
        let (lx, ly) = lazy((&x, &y), 0);
        let eager_ce = x.f_log_softmax(-1, None).and_then(|l| l.f_nll_loss(&y, None::<Tensor>, Reduction::Mean, -100));
        agree("cross_entropy", eager_ce, lx.f_cross_entropy_for_logits(&ly), micro, Split::Exact)?;
        let logp = x.log_softmax(-1, None);
        let w = randn(&[c]).abs();
        agree("nll", logp.f_nll_loss(&y, Some(&w), red, -100), lazy(&logp, 0).f_nll_loss(&ly, Some(&w), red, -100), micro, Split::Exact)?;
        let target = randn(&[n, c]);
        agree("mse", x.f_mse_loss(&target, red), lx.f_mse_loss(&lazy(&target, 0), red), micro, Split::Exact)?;
        let lt = lazy(&target, 0);
        agree("smooth_l1", x.f_smooth_l1_loss(&target, red, 0.5), lx.f_smooth_l1_loss(&lt, red, 0.5), micro, Split::Exact)?;
        agree("huber", x.f_huber_loss(&target, red, 0.7), lx.f_huber_loss(&lt, red, 0.7), micro, Split::Exact)?;
        let probability = target.sigmoid();
        let eager_bce = x.f_binary_cross_entropy_with_logits(&probability, None::<&Tensor>, None::<&Tensor>, red);
        agree("bce with logits", eager_bce, lx.f_binary_cross_entropy_with_logits(&lazy(&probability, 0), None::<&Tensor>, None::<&Tensor>, red), micro, Split::Exact)?;
        // A fixed target broadcast over the batch (a row of targets for every sample).
        let row = randn(&[c]);
        agree("mse, fixed target", x.f_mse_loss(&row, red), lx.f_mse_loss(&row, red), micro, Split::Exact)?;
        // cross_entropy_loss: weights, reductions, label smoothing.
        let eps = [0.0, 0.1, 0.35][reduction];
        agree("cross_entropy_loss", x.f_cross_entropy_loss(&y, None::<&Tensor>, red, -100, eps), lx.f_cross_entropy_loss(&ly, None::<&Tensor>, red, -100, eps), micro, Split::Exact)?;
        agree("cross_entropy_loss weighted", x.f_cross_entropy_loss(&y, Some(&w), red, -100, 0.0), lx.f_cross_entropy_loss(&ly, Some(&w), red, -100, 0.0), micro, Split::Exact)?;
        prop_assert!(lx.f_cross_entropy_loss(&ly, Some(&w), red, -100, 0.2).is_err(), "smoothing with weights is refused");
        prop_assert!(lx.f_cross_entropy_loss(&ly, None::<&Tensor>, red, -100, 1.5).is_err(), "smoothing above 1 is refused");
        // KL divergence of log-probabilities, the target as probabilities or log-probabilities.
        let log_q = target.log_softmax(-1, None);
        let (lp, lq) = (lazy(&logp, 0), lazy(&log_q, 0));
        agree("kl_div", logp.f_kl_div(&log_q.exp(), red, false), lp.f_kl_div(&lazy(&log_q.exp(), 0), red, false), micro, Split::Exact)?;
        agree("kl_div log target", logp.f_kl_div(&log_q, red, true), lp.f_kl_div(&lq, red, true), micro, Split::Exact)?;
        let bad = Tensor::randint(c, [n + 1], (Kind::Int64, CPU));
        agree("nll shape", logp.f_nll_loss(&bad, None::<Tensor>, red, -100), LazyTensor::fixed(&logp).f_nll_loss(&bad, None::<&Tensor>, red, -100), 1, Split::Exact)?;
    }

    #[test]
    fn pair_and_probability_losses_every_reduction(
        n in 1i64..7,
        d in 1i64..5,
        micro in 1usize..7,
        reduction in 0usize..3,
        margin in -0.5f64..1.0,
        p in prop::sample::select(vec![1.0f64, 2.0, 3.0]),
        swap in any::<bool>(),
        fixed in any::<bool>(),
        full in any::<bool>(),
    ) {
        let red = [Reduction::Mean, Reduction::Sum, Reduction::None][reduction];
        let sign = |shape: &[i64]| Tensor::randint(3, shape, (Kind::Int64, CPU)).to_kind(Kind::Double) - 1.0;
        let (x1, x2, x3) = (randn(&[n, d]), randn(&[n, d]), randn(&[n, d]));
        let (l1, l2, l3) = lazy((&x1, &x2, &x3), 0);
        // The second operand is a fixed row broadcast over the batch, or per-sample.
        let row = randn(&[1, d]);
        let (e2, f2) = if fixed { (&row, LazyTensor::fixed(&row)) } else { (&x2, l2.clone()) };
        let t = sign(&[n]);
        let what = |loss: &str| format!("{loss} n {n} d {d} {red:?} fixed {fixed}");
        agree(&what("cosine_embedding"), Tensor::f_cosine_embedding_loss(&x1, e2, &t, margin, red), LazyTensor::f_cosine_embedding_loss(&l1, &f2, &lazy(&t, 0), margin, red), micro, Split::Exact)?;
        // Integer targets, as libtorch takes them.
        let ti = t.to_kind(Kind::Int64);
        agree(&what("cosine_embedding, Int64 target"), Tensor::f_cosine_embedding_loss(&x1, &x2, &ti, margin, red), LazyTensor::f_cosine_embedding_loss(&l1, &l2, &lazy(&ti, 0), margin, red), micro, Split::Exact)?;
        // One pair of vectors, the batch along the features: mixes.
        let (v1, v2) = (randn(&[n]), randn(&[n]));
        let one = Tensor::from(1.0f64);
        agree(&what("cosine_embedding of vectors"), Tensor::f_cosine_embedding_loss(&v1, &v2, &one, margin, red), LazyTensor::f_cosine_embedding_loss(&lazy(&v1, 0), &v2, &one, margin, red), micro, Split::Refused)?;
        agree(&what("cosine_embedding, bad target"), Tensor::f_cosine_embedding_loss(&x1, &x2, &sign(&[n, 1]), margin, red), LazyTensor::f_cosine_embedding_loss(&l1, &l2, &lazy(&sign(&[n, 1]), 0), margin, red), micro, Split::Exact)?;
        let unwrapped = LazyTensor::f_cosine_embedding_loss(&l1, &l2, &t, margin, red);
        prop_assert!(n == 1 || matches!(unwrapped, Err(LazyError::Batch { .. })), "an unwrapped target of the batch's size is refused");

        let td = sign(&[n, d]);
        agree(&what("margin_ranking"), Tensor::f_margin_ranking_loss(&x1, e2, &td, margin, red), LazyTensor::f_margin_ranking_loss(&l1, &f2, &lazy(&td, 0), margin, red), micro, Split::Exact)?;
        let (r1, r2) = (randn(&[n]), randn(&[n]));
        agree(&what("margin_ranking of scores"), Tensor::f_margin_ranking_loss(&r1, &r2, &t, margin, red), LazyTensor::f_margin_ranking_loss(&lazy(&r1, 0), &lazy(&r2, 0), &lazy(&t, 0), margin, red), micro, Split::Exact)?;
        // Scores [n] broadcast against rows [n, d] (right-aligned, as libtorch does): the
        // batch meets the features.
        agree(&what("margin_ranking, dimensions differ"), Tensor::f_margin_ranking_loss(&x1, &x2, &t, margin, red), LazyTensor::f_margin_ranking_loss(&l1, &l2, &lazy(&t, 0), margin, red), micro, Split::Refused)?;

        agree(&what("triplet_margin"), Tensor::f_triplet_margin_loss(&x1, e2, &x3, margin, p, 1e-6, swap, red), LazyTensor::f_triplet_margin_loss(&l1, &f2, &l3, margin, p, 1e-6, swap, red), micro, Split::Exact)?;
        agree(&what("triplet_margin of vectors"), Tensor::f_triplet_margin_loss(&v1, &v2, &r1, margin, p, 1e-6, swap, red), LazyTensor::f_triplet_margin_loss(&lazy(&v1, 0), &lazy(&v2, 0), &lazy(&r1, 0), margin, p, 1e-6, swap, red), micro, Split::Refused)?;
        agree(&what("triplet_margin, dimensions differ"), Tensor::f_triplet_margin_loss(&x1, &x2, &r1, margin, p, 1e-6, swap, red), LazyTensor::f_triplet_margin_loss(&l1, &l2, &lazy(&r1, 0), margin, p, 1e-6, swap, red), micro, Split::Exact)?;

        let (prob, target) = (x1.sigmoid(), x2.sigmoid());
        let (lp, lt) = lazy((&prob, &target), 0);
        agree(&what("binary_cross_entropy"), prob.f_binary_cross_entropy(&target, None::<&Tensor>, red), lp.f_binary_cross_entropy(&lt, None::<&Tensor>, red), micro, Split::Exact)?;
        let w = randn(&[d]).abs();
        agree(&what("binary_cross_entropy, fixed weight"), prob.f_binary_cross_entropy(&target, Some(&w), red), lp.f_binary_cross_entropy(&lt, Some(&w), red), micro, Split::Exact)?;
        let wn = x3.abs();
        agree(&what("binary_cross_entropy, per-sample weight"), prob.f_binary_cross_entropy(&target, Some(&wn), red), lp.f_binary_cross_entropy(&lt, Some(&lazy(&wn, 0)), red), micro, Split::Exact)?;
        // libtorch squeezes input and target and broadcasts them (`[2, 2]` against `[2, 1]` pairs
        // the target's rows with the input's columns); PyTorch refuses a target of another
        // size, and so does toma.
        let other = lp.f_binary_cross_entropy(&lt.sum_dim_intlist([1], true, None), None::<&Tensor>, red);
        prop_assert!(d == 1 || matches!(other, Err(LazyError::Shape { .. })), "a target of another size is refused");

        let counts = Tensor::randint(5, [n, d], (Kind::Int64, CPU)).to_kind(Kind::Double);
        let lc = lazy(&counts, 0);
        agree(&what("poisson_nll_loss log input"), x1.f_poisson_nll_loss(&counts, true, full, 1e-8, red), l1.f_poisson_nll_loss(&lc, true, full, 1e-8, red), micro, Split::Exact)?;
        let rate = x1.abs() + 0.1;
        agree(&what("poisson_nll_loss"), rate.f_poisson_nll_loss(&counts, false, full, 1e-8, red), lazy(&rate, 0).f_poisson_nll_loss(&lc, false, full, 1e-8, red), micro, Split::Exact)?;
        let fixed_counts = counts.get(0).unsqueeze(0);
        agree(&what("poisson_nll_loss, fixed counts"), x1.f_poisson_nll_loss(&fixed_counts, true, full, 1e-8, red), l1.f_poisson_nll_loss(&fixed_counts, true, full, 1e-8, red), micro, Split::Exact)?;
    }

    /// CTC against padded and concatenated targets, lengths as lists and as tensors, every
    /// reduction: whole and in micro-batches (the lists and concatenated targets sliced to
    /// each), tch's values; concatenated targets with lengths as tensors refuse a split.
    #[test]
    fn ctc_loss_every_reduction(
        n in 1i64..6,
        t in 1i64..8,
        c in 2i64..6,
        s in 0i64..4,
        micro in 1usize..7,
        reduction in 0usize..3,
        zero_infinity in any::<bool>(),
        int32 in any::<bool>(),
        blank in 0i64..2,
    ) {
        let red = [Reduction::Mean, Reduction::Sum, Reduction::None][reduction];
        let blank = blank.min(c - 1);
        let lp = randn(&[t, n, c]).log_softmax(2, None);
        let kind = if int32 { Kind::Int } else { Kind::Int64 };
        // Labels other than the blank.
        let labels = Tensor::randint_low(0, c - 1, [n, s], (Kind::Int64, CPU));
        let targets = (&labels + labels.ge(blank).to_kind(Kind::Int64)).to_kind(kind);
        let il: Vec<i64> = Vec::try_from(Tensor::randint(t + 1, [n], (Kind::Int64, CPU))).unwrap();
        let tl: Vec<i64> = Vec::try_from(Tensor::randint(s + 1, [n], (Kind::Int64, CPU))).unwrap();
        let pieces: Vec<Tensor> = tl.iter().enumerate().map(|(i, &l)| targets.get(i as i64).narrow(0, 0, l)).collect();
        let concatenated = Tensor::cat(&pieces, 0);
        let (il_t, tl_t) = (Tensor::from_slice(&il), Tensor::from_slice(&tl));
        let what = |form: &str| format!("ctc {form} n {n} t {t} c {c} s {s} {red:?} zero_infinity {zero_infinity} {kind:?} lengths {il:?} {tl:?}");
        let llp = lazy(&lp, 1);
        let (lt, lil, ltl) = lazy((&targets, &il_t, &tl_t), 0);
        agree(&what("padded"), Tensor::f_ctc_loss(&lp, &targets, &il, &tl, blank, red, zero_infinity), LazyTensor::f_ctc_loss(&llp, &lt, &il, &tl, blank, red, zero_infinity), micro, Split::Exact)?;
        agree(&what("concatenated"), Tensor::f_ctc_loss(&lp, &concatenated, &il, &tl, blank, red, zero_infinity), LazyTensor::f_ctc_loss(&llp, &concatenated, &il, &tl, blank, red, zero_infinity), micro, Split::Exact)?;
        agree(&what("tensor lengths"), Tensor::f_ctc_loss_tensor(&lp, &targets, &il_t, &tl_t, blank, red, zero_infinity), LazyTensor::f_ctc_loss_tensor(&llp, &lt, &lil, &ltl, blank, red, zero_infinity), micro, Split::Exact)?;
        agree(&what("concatenated, tensor lengths"), Tensor::f_ctc_loss_tensor(&lp, &concatenated, &il_t, &tl_t, blank, red, zero_infinity), LazyTensor::f_ctc_loss_tensor(&llp, &concatenated, &lil, &ltl, blank, red, zero_infinity), micro, Split::Refused)?;
        // One unbatched sequence, `[T, C]`.
        let one = lp.select(1, 0);
        let (il1, tl1) = ([il[0]], [tl[0]]);
        agree(&what("unbatched"), Tensor::f_ctc_loss(&one, &pieces[0], il1, tl1, blank, red, zero_infinity), LazyTensor::f_ctc_loss(&one, &pieces[0], il1, tl1, blank, red, zero_infinity), micro, Split::Refused)?;
        // Refused when recorded, as tch refuses them when they run (or as an unwrapped
        // operand would be wrong).
        let unwrapped = LazyTensor::f_ctc_loss(&llp, &targets, &il, &tl, blank, red, zero_infinity);
        prop_assert!(n == 1 || matches!(unwrapped, Err(LazyError::Batch { .. })), "unwrapped targets of the batch's size");
        let short = &il[..il.len() - 1];
        prop_assert!(LazyTensor::f_ctc_loss(&llp, &lt, short, &tl, blank, red, zero_infinity).is_err(), "a length missing");
        prop_assert!(LazyTensor::f_ctc_loss(&llp, &lt, &il, &tl, c, red, zero_infinity).is_err(), "a blank out of range");
        let long: Vec<i64> = il.iter().map(|l| l + t + 1).collect();
        agree(&what("lengths past T"), Tensor::f_ctc_loss(&lp, &targets, &long, &tl, blank, red, zero_infinity), LazyTensor::f_ctc_loss(&llp, &lt, &long, &tl, blank, red, zero_infinity), micro, Split::Exact)?;
        let longer: Vec<i64> = tl.iter().map(|l| l + s + 1).collect();
        agree(&what("targets shorter than their lengths"), Tensor::f_ctc_loss(&lp, &targets, &il, &longer, blank, red, zero_infinity), LazyTensor::f_ctc_loss(&llp, &lt, &il, &longer, blank, red, zero_infinity), micro, Split::Exact)?;
    }
}

#[test]
fn a_custom_op_plans_and_runs_like_a_builtin() {
    use toma::lazy::{CustomOp, Saves, TensorMeta};
    // Pairs of features summed: [N, 2k] -> [N, k].
    let pairs = CustomOp::new(
        "pair_sum",
        |ins: &[TensorMeta]| {
            let s = &ins[0].shape;
            if s.len() != 2 || s[1] % 2 != 0 {
                return Err(format!("expected [N, 2k], got {s:?}"));
            }
            Ok(TensorMeta { shape: vec![s[0], s[1] / 2], ..ins[0].clone() })
        },
        |xs| xs[0].f_view([-1, 2])?.f_sum_dim_intlist(&[1i64][..], false, None)?.f_view([xs[0].size()[0], -1]),
    )
    .saves(Saves::Nothing);
    let x = randn(&[7, 6]);
    let l = pairs.apply(&[&lazy(&x, 0)]).unwrap();
    assert_eq!(l.size(), [7, 3]);
    let eager = x.view([-1, 2]).sum_dim_intlist(&[1i64][..], false, None).view([7, -1]);
    for micro in [1, 3, 7] {
        let v = l.to_tensor_with(&Options::new().micro_batch(micro)).unwrap();
        assert!(v.allclose(&eager, 1e-12, 1e-12, false), "micro-batch {micro}");
    }
    // The rule's refusal is an error naming the op, at recording time.
    let err = pairs.apply(&[&lazy(&randn(&[3, 5]), 0)]).unwrap_err();
    assert!(err.to_string().contains("pair_sum") && err.to_string().contains("[3, 5]"), "{err}");
    // A rule that drops the batch dimension makes the op unsplittable, not silently eager.
    let total = CustomOp::new(
        "total",
        |ins| Ok(TensorMeta { shape: vec![], batch_dim: None, ..ins[0].clone() }),
        |xs| xs[0].f_sum(None),
    );
    let t = total.apply(&[&lazy(&x, 0)]).unwrap();
    assert!(matches!(t.to_tensor_with(&Options::new().micro_batch(2)), Err(LazyError::MixesBatch { .. })));
    assert!(t.to_tensor().unwrap().allclose(&x.sum(None), 1e-12, 1e-12, false));
}

/// Found by `shape_ops_follow_the_batch`: a reshape recorded as a copy (the full batch's strides
/// allow no view) fed a view; on a micro-batch of 3 libtorch's reshape returned a strided view
/// instead, which that view could not take. The executor now makes such a reshape contiguous.
#[test]
fn a_view_after_a_copying_reshape_runs_on_any_micro_batch() {
    let t = randn(&[4, 1, 2, 2]);
    let l = lazy(&t, 0).transpose(-3, 3).reshape([8, 2, 1]).reshape([16, 1]);
    let eager = t.transpose(-3, 3).reshape([8, 2, 1]).reshape([16, 1]);
    for micro in 1..=4 {
        let value = l.to_tensor_with(&Options::new().micro_batch(micro)).unwrap();
        assert!(value.equal(&eager), "micro-batch {micro}");
    }
}

/// `nonzero` and `argwhere` have an output whose shape depends on the values: refused when
/// recorded, with what to do instead; tch's run eagerly.
#[test]
fn nonzero_and_argwhere_are_refused_with_what_to_do_instead() {
    let t = randn(&[4, 3]).relu();
    let l = lazy(&t, 0);
    for (op, refused) in [("nonzero", l.f_nonzero()), ("argwhere", l.f_argwhere())] {
        let Err(e) = refused else { panic!("{op} must be refused") };
        assert!(matches!(&e, LazyError::Unsupported { op: o, .. } if o == op), "{e:?}");
        let text = e.to_string();
        assert!(text.starts_with(&format!("toma::lazy: `{op}` cannot be planned: ")), "{text}");
        for hint in ["depends on the values", "where_self", "masked_fill", "to_tensor()"] {
            assert!(text.contains(hint), "{op}'s error names `{hint}`: {text}");
        }
    }
    let panicked = std::panic::catch_unwind(|| lazy(&t, 0).nonzero()).expect_err("the twin panics");
    let message = panicked.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("`nonzero` cannot be planned"), "{message}");
    // Eagerly, on the value: tch's.
    let eager = lazy(&t, 0).to_tensor().unwrap().nonzero();
    assert_eq!(eager.size(), t.nonzero().size());
}

proptest! {
    #![proptest_config(cases(96))]

    #[test]
    fn pixel_shuffles_wherever_the_batch_is(
        lead in prop::collection::vec(1i64..4, 0..=2),
        (c, h, w) in (1i64..4, 1i64..4, 1i64..4),
        r in 0i64..4,
        batch_dim in 0usize..5,
        micro in 1usize..4,
    ) {
        // [..lead, C·r², H, W] (shuffle) and [..lead, C, H·r, W·r] (unshuffle); r = 0 and
        // unfitting sizes are refused by both. The batch along a leading dimension splits;
        // along the channels or the sides, entries move between samples.
        let rr = r.max(1);
        let shuffled: Vec<i64> = [lead.clone(), vec![c * rr * rr, h, w]].concat();
        let unshuffled: Vec<i64> = [lead.clone(), vec![c, h * rr, w * rr + i64::from(w == 3)]].concat();
        let nd = shuffled.len();
        let bd = batch_dim.min(nd - 1);
        let split = if bd + 3 >= nd { Split::Refused } else { Split::Exact };
        let t = randn(&shuffled);
        agree(&format!("pixel_shuffle {shuffled:?} r {r} batch {bd}"), t.f_pixel_shuffle(r), lazy(&t, bd).f_pixel_shuffle(r), micro, split)?;
        let u = randn(&unshuffled);
        agree(&format!("pixel_unshuffle {unshuffled:?} r {r} batch {bd}"), u.f_pixel_unshuffle(r), lazy(&u, bd).f_pixel_unshuffle(r), micro, split)?;
        // Integers move as they are.
        let i = Tensor::randint(9, shuffled.as_slice(), (Kind::Int64, CPU));
        agree("pixel_shuffle Int64", i.f_pixel_shuffle(r), lazy(&i, bd).f_pixel_shuffle(r), micro, split)?;
        let small = randn(&[c, h]);
        agree("pixel_shuffle 2-D", small.f_pixel_shuffle(1), lazy(&small, 0).f_pixel_shuffle(1), micro, Split::Exact)?;
    }

    #[test]
    fn upsample_nearest1d_sizes_and_scales(
        (n, c, l) in (1i64..4, 1i64..4, 1i64..7),
        out in 0i64..13,
        scale in prop::option::of(0.3f64..3.0),
        micro in 1usize..4,
        batch_on_channels in any::<bool>(),
    ) {
        let x = randn(&[n, c, l]);
        let bd = usize::from(batch_on_channels);
        agree(&format!("upsample_nearest1d {l} to {out} scale {scale:?}"), x.f_upsample_nearest1d([out].as_slice(), scale), lazy(&x, bd).f_upsample_nearest1d([out], scale), micro, Split::Exact)?;
        agree("upsample_nearest1d, two sizes", x.f_upsample_nearest1d([out, out].as_slice(), scale), lazy(&x, bd).f_upsample_nearest1d([out, out], scale), micro, Split::Exact)?;
        let flat = randn(&[n, l]);
        agree("upsample_nearest1d 2-D", flat.f_upsample_nearest1d([out].as_slice(), scale), lazy(&flat, 0).f_upsample_nearest1d([out], scale), micro, Split::Exact)?;
        // Along the length, windows of samples: refused.
        agree("upsample_nearest1d along the batch", x.f_upsample_nearest1d([out].as_slice(), scale), lazy(&x, 2).f_upsample_nearest1d([out], scale), micro, Split::Refused)?;
    }

    #[test]
    fn unfold_any_dim(a in shape(4, 6), dim in -5i64..5, size in -1i64..5, step in 0i64..4, batch_dim in 0usize..4, transposed in any::<bool>(), micro in 1usize..5) {
        // Also on a transposed (strided) input; a 0-dim one too.
        let t = randn(&a);
        let t = if transposed && a.len() > 1 { t.transpose(0, -1) } else { t };
        let rank = a.len() as i64;
        let bd = batch_dim.min(a.len() - 1);
        let along_batch = dim >= -rank && dim < rank && dim.rem_euclid(rank) as usize == bd;
        let split = if along_batch { Split::Refused } else { Split::Exact };
        agree(&format!("unfold {:?} dim {dim} size {size} step {step} batch {bd}", t.size()), t.f_unfold(dim, size, step), lazy(&t, bd).f_unfold(dim, size, step), micro, split)?;
        // A window of windows, then a copy: the view's strides are the micro-batch's own.
        let eager = t.f_unfold(dim, size, step).and_then(|u| u.f_unfold(-1, 1, 1)).and_then(|u| u.f_mul_scalar(2.0));
        let lazily = lazy(&t, bd).f_unfold(dim, size, step).and_then(|u| u.f_unfold(-1, 1, 1)).and_then(|u| u.f_mul_scalar(2.0));
        agree("unfold twice", eager, lazily, micro, split)?;
        let scalar = Tensor::from(1.5f64);
        agree("unfold 0-dim", scalar.f_unfold(dim, size, step), LazyTensor::fixed(&scalar).f_unfold(dim, size, step), micro, Split::Exact)?;
    }
}

proptest! {
    #![proptest_config(cases(96))]

    #[test]
    fn scatter_and_scatter_add_wherever_the_batch_is(
        a in shape(3, 4),
        d in 0usize..3,
        negative in any::<bool>(),
        extra in 0i64..2,
        which in 0usize..4,
        micro in 1usize..5,
    ) {
        // `self` [a] is split with the batch (dimension 0); the index and `src` too (which 0),
        // or the index fixed (1), or `src` fixed (2), or `self` fixed (3). `scatter` takes a
        // permutation along `d` (no index repeats: which write wins is libtorch's business),
        // `scatter_add` repeated indices. `src` may be larger than the index.
        let rank = a.len();
        let d = d % rank;
        let dim = if negative { d as i64 - rank as i64 } else { d as i64 };
        let t = randn(&a);
        let perm = Tensor::rand(a.as_slice(), F64).argsort(d as i64, false);
        let repeats = Tensor::randint(a[d], a.as_slice(), (Kind::Int64, CPU));
        let bigger: Vec<i64> = a.iter().enumerate().map(|(k, &s)| if k == 0 { s } else { s + extra }).collect();
        let src = randn(&bigger);
        let split = if d == 0 || which != 0 { Split::Refused } else { Split::Exact };
        let lift = |x: &Tensor, batched: bool| if batched { lazy(x, 0) } else { LazyTensor::fixed(x) };
        let (ls, lsrc) = (lift(&t, which != 3), lift(&src, which != 2));
        for (name, index) in [("scatter", &perm), ("scatter_add", &repeats)] {
            let li = lift(index, which != 1);
            let what = format!("{name} {a:?} dim {dim} src {bigger:?} case {which}");
            let (eager, lazily) = if name == "scatter" {
                (t.f_scatter(dim, index, &src), ls.f_scatter(dim, &li, &lsrc))
            } else {
                (t.f_scatter_add(dim, index, &src), ls.f_scatter_add(dim, &li, &lsrc))
            };
            agree(&what, eager, lazily, micro, split)?;
        }
        // Refused by both: an index that is not Int64, a `src` of another kind, a smaller `src`.
        let float_index = lazy(&perm.to_kind(Kind::Float), 0);
        agree("scatter, float index", t.f_scatter(dim, &perm.to_kind(Kind::Float), &src), lazy(&t, 0).f_scatter(dim, &float_index, &lazy(&src, 0)), micro, Split::Exact)?;
        let src32 = src.to_kind(Kind::Float);
        agree("scatter_add, src kind", t.f_scatter_add(dim, &repeats, &src32), lazy(&t, 0).f_scatter_add(dim, &lazy(&repeats, 0), &lazy(&src32, 0)), micro, Split::Exact)?;
        if rank > 1 && a[rank - 1] > 1 {
            let small = src.narrow(-1, 0, 1);
            agree("scatter, small src", t.f_scatter(dim, &perm, &small), lazy(&t, 0).f_scatter(dim, &lazy(&perm, 0), &lazy(&small, 0)), micro, Split::Exact)?;
        }
    }

    #[test]
    fn index_add_wherever_the_batch_is(a in shape(3, 4), d in 0usize..3, k in 1i64..5, which in 0usize..3, micro in 1usize..5) {
        // `self` [a] split with the batch (dimension 0), `source` too (which 0) or fixed (1), or
        // the index split with the batch (2: a 1-D index along the batch, `d` 0 only).
        let rank = a.len();
        let d = d % rank;
        let t = randn(&a);
        let mut source_shape = a.clone();
        source_shape[d] = if which == 2 { a[0] } else { k };
        let source = randn(&source_shape);
        let index = Tensor::randint(a[d], [source_shape[d]], (Kind::Int64, CPU));
        let lsource = if which == 1 || d == 0 { LazyTensor::fixed(&source) } else { lazy(&source, 0) };
        let lindex = if which == 2 { lazy(&index, 0) } else { LazyTensor::fixed(&index) };
        let split = if d == 0 || which != 0 { Split::Refused } else { Split::Exact };
        agree(&format!("index_add {a:?} dim {d} source {source_shape:?} case {which}"), t.f_index_add(d as i64, &index, &source), lazy(&t, 0).f_index_add(d as i64, &lindex, &lsource), micro, split)?;
        // Refused by both: a 2-D index, a source of another shape, a float index.
        let index2 = index.unsqueeze(0);
        agree("index_add, 2-D index", t.f_index_add(d as i64, &index2, &source), lazy(&t, 0).f_index_add(d as i64, &index2, &source), micro, Split::Exact)?;
        let wide = randn(&[&source_shape[..], &[2]].concat());
        agree("index_add, wide source", t.f_index_add(d as i64, &index, &wide), lazy(&t, 0).f_index_add(d as i64, &index, &wide), micro, Split::Exact)?;
        let float_index = index.to_kind(Kind::Float);
        agree("index_add, float index", t.f_index_add(d as i64, &float_index, &source), lazy(&t, 0).f_index_add(d as i64, &float_index, &source), micro, Split::Exact)?;
    }

    #[test]
    fn masked_scatter_mixes_samples(a in shape(3, 4), broadcast_mask in any::<bool>(), batched in any::<bool>(), micro in 1usize..5) {
        let t = randn(&a);
        let mask_shape: Vec<i64> = if broadcast_mask { a[1..].to_vec() } else { a.clone() };
        let mask = randn(&mask_shape).gt(0.0);
        let total: i64 = a.iter().product();
        // Enough entries for every mask here (the broadcast one below takes two rows).
        let source = randn(&[total + 2 * a[a.len() - 1]]);
        let lt = if batched { lazy(&t, 0) } else { LazyTensor::fixed(&t) };
        let split = if batched { Split::Refused } else { Split::Exact };
        agree(&format!("masked_scatter {a:?} mask {mask_shape:?}"), t.f_masked_scatter(&mask, &source), lt.f_masked_scatter(&mask, &source), micro, split)?;
        // A mask `self` broadcasts to; an integer mask and a source of another kind are refused.
        let wider = randn(&[2, a[a.len() - 1]]).gt(0.0);
        let row = randn(&[a[a.len() - 1]]);
        agree("masked_scatter, self broadcast", row.f_masked_scatter(&wider, &source), LazyTensor::fixed(&row).f_masked_scatter(&wider, &source), micro, Split::Exact)?;
        agree("masked_scatter, int mask", t.f_masked_scatter(&mask.to_kind(Kind::Int64), &source), lt.f_masked_scatter(&mask.to_kind(Kind::Int64), &source), micro, split)?;
        agree("masked_scatter, source kind", t.f_masked_scatter(&mask, &source.to_kind(Kind::Float)), lt.f_masked_scatter(&mask, &source.to_kind(Kind::Float)), micro, split)?;
    }
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn conv3d_every_parameter(
        n in 1i64..3,
        batched in any::<bool>(),
        (groups, cin_per, cout_per) in (1i64..3, 1i64..3, 1i64..3),
        side in 1i64..6,
        k in 1i64..4,
        stride in prop::collection::vec(1i64..3, 1..=3),
        padding in prop::collection::vec(0i64..2, 1..=3),
        dilation in 1i64..3,
        bias in any::<bool>(),
        micro in 1usize..3,
    ) {
        // Two stride values are refused by both, as libtorch refuses them.
        let spatial = [side, side + 1, (side - 1).max(1)];
        let shape: Vec<i64> = [if batched { vec![n] } else { vec![] }, vec![groups * cin_per], spatial.to_vec()].concat();
        let x = randn(&shape);
        let wt = randn(&[groups * cout_per, cin_per, k, k, 2]);
        let b = randn(&[groups * cout_per]);
        let bias_t = bias.then_some(&b);
        let eager = x.f_conv3d(&wt, bias_t, stride.as_slice(), padding.as_slice(), [dilation].as_slice(), groups);
        let lx = if batched { lazy(&x, 0) } else { LazyTensor::fixed(&x) };
        let lazy_t = lx.f_conv3d(&wt, bias_t, &stride, &padding, [dilation], groups);
        agree(&format!("conv3d {shape:?} s{stride:?} p{padding:?} d{dilation} g{groups} k{k}"), eager, lazy_t, micro, Split::Exact)?;
    }

    #[test]
    fn pool3d_every_parameter(
        shape in (1i64..4, 1i64..3, 1i64..6, 1i64..6, 1i64..6),
        kernel in prop::collection::vec(1i64..4, 1..=3),
        stride in prop::collection::vec(1i64..3, 0..=3),
        padding in prop::collection::vec(0i64..2, 1..=3),
        dilation in prop::collection::vec(1i64..3, 1..=3),
        ceil_mode in any::<bool>(),
        count_include_pad in any::<bool>(),
        divisor in prop::option::of(0i64..4),
        unbatched in any::<bool>(),
        micro in 1usize..4,
    ) {
        // A 4-D input [C, D, H, W] with the batch along C also splits: pooling is per channel.
        let x = randn(&[shape.0, shape.1, shape.2, shape.3, shape.4]);
        let x = if unbatched { x.select(0, 0) } else { x };
        let what = format!("{:?} k{kernel:?} s{stride:?} p{padding:?} d{dilation:?} ceil {ceil_mode}", x.size());
        let eager = x.f_max_pool3d(kernel.as_slice(), stride.as_slice(), padding.as_slice(), dilation.as_slice(), ceil_mode);
        let lazy_t = lazy(&x, 0).f_max_pool3d(&kernel, &stride, &padding, &dilation, ceil_mode);
        agree(&format!("max_pool3d {what}"), eager, lazy_t, micro, Split::Exact)?;
        let eager = x.f_avg_pool3d(kernel.as_slice(), stride.as_slice(), padding.as_slice(), ceil_mode, count_include_pad, divisor);
        let lazy_t = lazy(&x, 0).f_avg_pool3d(&kernel, &stride, &padding, ceil_mode, count_include_pad, divisor);
        agree(&format!("avg_pool3d {what} divisor {divisor:?}"), eager, lazy_t, micro, Split::Exact)?;
        // Along a spatial dimension, windows of samples: refused.
        let eager = x.f_max_pool3d(kernel.as_slice(), stride.as_slice(), padding.as_slice(), dilation.as_slice(), ceil_mode);
        let lazy_t = lazy(&x, x.dim() - 1).f_max_pool3d(&kernel, &stride, &padding, &dilation, ceil_mode);
        agree(&format!("max_pool3d along the batch {what}"), eager, lazy_t, micro, Split::Refused)?;
    }
}

/// `einsum` cases: the equation, each operand's dimensions named by size (`b` is the batch's
/// size, a letter's size is shared wherever it is named), each operand's batch dimension
/// (`None`: fixed), a contraction path, and what a split does.
type EinsumCase = (&'static str, &'static [&'static str], &'static [Option<usize>], Option<&'static [i64]>, Split);

const EINSUM_CASES: &[EinsumCase] = &[
    ("bij,jk->bik", &["bij", "jk"], &[Some(0), None], None, Split::Exact),
    ("bhqd,bhkd->bhqk", &["bhqd", "bhkd"], &[Some(0), Some(0)], None, Split::Exact),
    ("bi,bi->b", &["bi", "bi"], &[Some(0), Some(0)], None, Split::Exact),
    ("bi,bj->bij", &["bi", "bj"], &[Some(0), Some(0)], None, Split::Exact),
    ("bi,j->bij", &["bi", "j"], &[Some(0), None], None, Split::Exact),
    ("i,j->ij", &["i", "j"], &[None, None], None, Split::Exact),
    // The batch inside a merged group (`[i, N] -> [i * N]`), and later in the output.
    ("ibj,jk->ibk", &["ibj", "jk"], &[Some(1), None], None, Split::Exact),
    ("ibj,jk->kbi", &["ibj", "jk"], &[Some(1), None], None, Split::Exact),
    ("hbqd,hbkd->hbqk", &["hbqd", "hbkd"], &[Some(1), Some(1)], None, Split::Exact),
    ("jk,bij->kib", &["jk", "bij"], &[None, Some(0)], None, Split::Exact),
    ("bij,j->bi", &["bij", "j"], &[Some(0), None], None, Split::Exact),
    // One operand: a permute, a sum.
    ("bij->bji", &["bij"], &[Some(0)], None, Split::Exact),
    ("bij->b", &["bij"], &[Some(0)], None, Split::Exact),
    ("bij", &["bij"], &[Some(0)], Some(&[0]), Split::Exact),
    // Implicit outputs (letters seen once, upper case first), ellipses.
    ("bij,kj", &["bij", "kj"], &[Some(0), None], None, Split::Exact),
    ("Bij,jk", &["bij", "jk"], &[Some(0), None], None, Split::Exact),
    ("...ij,jk->...ik", &["beij", "jk"], &[Some(0), None], None, Split::Exact),
    ("...ij,jk", &["ebij", "jk"], &[Some(1), None], None, Split::Exact),
    ("b...,b...->b...", &["bij", "bij"], &[Some(0), Some(0)], None, Split::Exact),
    ("...j,...j->...", &["bej", "ej"], &[Some(0), None], None, Split::Exact),
    // Three operands, left to right and along a path; a subscript only one operand has.
    ("bij,bjk,bkl->bil", &["bij", "bjk", "bkl"], &[Some(0), Some(0), Some(0)], None, Split::Exact),
    ("bij,bjk,bkl->bil", &["bij", "bjk", "bkl"], &[Some(0), Some(0), Some(0)], Some(&[1, 2, 0, 1]), Split::Exact),
    ("bij,jk,kl->bi", &["bij", "jk", "kl"], &[Some(0), None, None], None, Split::Exact),
    // The batch summed away, or two batches on different subscripts: samples mix.
    ("bi,bj->ij", &["bi", "bj"], &[Some(0), Some(0)], None, Split::Refused),
    ("bij,jk->ik", &["bij", "jk"], &[Some(0), None], None, Split::Refused),
    ("bij->ij", &["bij"], &[Some(0)], None, Split::Refused),
    ("bi,ci->bc", &["bi", "bi"], &[Some(0), Some(0)], None, Split::Refused),
    // Refused by both: an unknown output subscript, too few operands, a bad path.
    ("bij,jk->bq", &["bij", "jk"], &[Some(0), None], None, Split::Exact),
    ("bij,jk,kl->bil", &["bij", "jk"], &[Some(0), None], None, Split::Exact),
    ("bij,jk->bik", &["bij", "jk"], &[Some(0), None], Some(&[0, 0]), Split::Exact),
    ("bij,jk->bik", &["bij", "jk"], &[Some(0), None], Some(&[0, 1, 0]), Split::Exact),
];

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn einsum_as_libtorch(case in 0..EINSUM_CASES.len(), sizes in prop::collection::vec(1i64..5, 26), micro in 1usize..5) {
        let (equation, shapes, batched, path, split) = EINSUM_CASES[case];
        let size = |c: char| sizes[(c as u8 - b'a') as usize];
        let tensors: Vec<Tensor> =
            shapes.iter().map(|s| randn(&s.chars().map(size).collect::<Vec<_>>())).collect();
        let lazies: Vec<LazyTensor> = tensors
            .iter()
            .zip(batched)
            .map(|(t, b)| match b {
                Some(d) => lazy(t, *d),
                None => LazyTensor::fixed(t),
            })
            .collect();
        let what = format!("einsum {equation} {shapes:?} sizes {:?}", &sizes[..12]);
        agree(&what, Tensor::f_einsum(equation, &tensors, path), LazyTensor::f_einsum(equation, &lazies, path), micro, split)?;
    }
}

/// What `einsum` refuses where tch computes: a diagonal; a fixed operand the batch's size along
/// the batch's subscript; batches of different sizes.
#[test]
fn einsum_refusals() {
    let x = randn(&[4, 3, 3]);
    assert!(Tensor::f_einsum("bii->bi", &[&x], None::<i64>).is_ok());
    let refused = LazyTensor::f_einsum("bii->bi", &[lazy(&x, 0)], None::<i64>);
    assert!(matches!(refused, Err(LazyError::Unsupported { .. })), "{refused:?}");
    let w = randn(&[4, 5]);
    let fixed = LazyTensor::f_einsum("bij,bk->bijk", &[lazy(&x, 0), LazyTensor::fixed(&w)], None::<i64>);
    assert!(matches!(fixed, Err(LazyError::Batch { .. })), "{fixed:?}");
    let other = LazyTensor::f_einsum("bij,ck->bijck", &[lazy(&x, 0), lazy(&randn(&[2, 5]), 0)], None::<i64>);
    assert!(matches!(other, Err(LazyError::Batch { .. })), "{other:?}");
    // The reason a split is refused names the subscript summed away.
    let summed = LazyTensor::einsum("bij->ij", &[lazy(&x, 0)], None::<i64>).sum(None);
    let err = summed.to_tensor_with(&Options::new().micro_batch(2)).unwrap_err();
    assert!(err.to_string().contains("subscript b away"), "{err}");
}

proptest! {
    #![proptest_config(cases(128))]

    /// `index_put` on `[n, a, b, c]` split along 0: indices on other dimensions, adjacent (the
    /// indexed result keeps the batch first) or separated by `None` (the indices' shape comes
    /// first, the batch after it); values split with the batch or broadcast along it. An index
    /// on the batch dimension, or a per-sample index, is refused for a split.
    #[test]
    fn index_put_wherever_the_indices_are(
        dims in (1i64..5, 1i64..4, 1i64..4, 1i64..4),
        pattern in 0usize..6,
        k in 1i64..4,
        broadcast_values in any::<bool>(),
        accumulate in any::<bool>(),
        micro in 1usize..5,
    ) {
        let (n, a, b, c) = dims;
        let t = randn(&[n, a, b, c]);
        let ints = |high: i64| Tensor::randint(high, [k], (Kind::Int64, CPU));
        // (indices, the indexed shape, where the batch lands in it, split)
        let (indices, indexed, at, split): (Vec<Option<Tensor>>, Vec<i64>, Option<usize>, Split) = match pattern {
            0 => (vec![None, Some(ints(a))], vec![n, k, b, c], Some(0), Split::Exact),
            1 => (vec![None, None, Some(ints(b)), Some(ints(c))], vec![n, a, k], Some(0), Split::Exact),
            2 => (vec![None, Some(ints(a)), None, Some(ints(c))], vec![k, n, b], Some(1), Split::Exact),
            3 => (vec![None, None, None, Some(ints(c).to_kind(Kind::Int))], vec![n, a, b, k], Some(0), Split::Exact),
            4 => (vec![Some(ints(n)), Some(ints(a))], vec![k, b, c], None, Split::Refused),
            // Refused by both: no index tensor.
            _ => (vec![None, None], vec![n, a, b, c], Some(0), Split::Exact),
        };
        let (values, lvalues) = match at {
            Some(d) if !broadcast_values => {
                let v = randn(&indexed);
                let lv = lazy(&v, d);
                (v, lv)
            }
            _ => {
                // Broadcast along everything before the last dimension.
                let v = randn(&[indexed[indexed.len() - 1]]);
                let lv = LazyTensor::fixed(&v);
                (v, lv)
            }
        };
        let lindices: Vec<Option<&Tensor>> = indices.iter().map(Option::as_ref).collect();
        let what = format!("index_put {:?} pattern {pattern} values {:?} accumulate {accumulate}", t.size(), values.size());
        agree(&what, t.f_index_put(&lindices, &values, accumulate), lazy(&t, 0).f_index_put(&lindices, &lvalues, accumulate), micro, split)?;
        // A per-sample index (along dimension 1, picked per sample) is refused for a split.
        let per_sample = Tensor::randint(a, [n, 1, 1, 1], (Kind::Int64, CPU));
        let row = randn(&[c]);
        let eager = t.f_index_put(&[None, Some(&per_sample)], &row, accumulate);
        let lazily = lazy(&t, 0).f_index_put(&[None, Some(&lazy(&per_sample, 0))], &row, accumulate);
        // tch broadcasts [n, 1, 1, 1] with nothing: the indexed shape is [n, n, 1, 1, 1, b, c].
        if let (Ok(e), Ok(l)) = (&eager, &lazily) {
            prop_assert_eq!(e.size(), l.size());
        }
        agree("index_put, per-sample index", eager, lazily, micro, Split::Refused)?;
        // Refused by both: a float index, values of another kind, too many indices.
        let float_index = ints(a).to_kind(Kind::Double);
        agree("index_put, float index", t.f_index_put(&[None, Some(&float_index)], &row, false), lazy(&t, 0).f_index_put(&[None, Some(&float_index)], &row, false), micro, Split::Exact)?;
        let row32 = row.to_kind(Kind::Float);
        agree("index_put, values kind", t.f_index_put(&[None, Some(&ints(a))], &row32, false), lazy(&t, 0).f_index_put(&[None, Some(&ints(a))], &row32, false), micro, Split::Exact)?;
        let five: Vec<Option<&Tensor>> = vec![None; 5];
        agree("index_put, too many", t.f_index_put(&five, &row, false), lazy(&t, 0).f_index_put(&five, &row, false), micro, Split::Exact)?;
    }
}

/// A mask index is refused when recorded (its indexed shape depends on its values).
#[test]
fn index_put_refuses_masks() {
    let t = randn(&[4, 3]);
    let mask = Tensor::from_slice(&[true, false, true]);
    let refused = lazy(&t, 0).f_index_put(&[None, Some(&mask)], &randn(&[1]), false);
    assert!(matches!(refused, Err(LazyError::Unsupported { .. })), "{refused:?}");
}

/// `pow_tensor_scalar` takes an integer or a float as tch does, and promotes as libtorch: an
/// integer tensor raised to an integer stays an integer, to a float becomes a float.
#[test]
fn pow_takes_integer_and_float_exponents_as_tch() {
    let f = Tensor::from_slice(&[1.5f64, -2.0, 3.0]).view([3, 1]);
    let i = Tensor::from_slice(&[1i64, -2, 3]).view([3, 1]);
    for (t, exponent) in [(&f, 2.0f64), (&f, 0.5), (&i, 2.0)] {
        let lazy_value = lazy(t, 0).pow_tensor_scalar(exponent).to_tensor().unwrap();
        let eager = t.pow_tensor_scalar(exponent);
        assert_eq!(lazy_value.kind(), eager.kind());
        assert!(lazy_value.allclose(&eager, 1e-12, 1e-12, true));
    }
    for t in [&f, &i] {
        let lazy_value = lazy(t, 0).pow_tensor_scalar(2).to_tensor().unwrap();
        let eager = t.pow_tensor_scalar(2);
        assert_eq!(lazy_value.kind(), eager.kind(), "an integer exponent");
        assert!(lazy_value.equal(&eager));
    }
}
