//! `docs/ops.md`, the table of every op `toma::lazy` records, is generated from the op family
//! files (`src/lazy/ops/*.rs`: each `pub fn f_op` and the first line of its documentation) and
//! from the ops themselves (each recorded once on sample operands, its `op_costs` read: how a
//! split treats it and what the planner charges it), so it cannot drift: this test fails when
//! the table differs from the code, or when an op has no sample here.
//! `TOMA_WRITE_OP_TABLE=1 cargo test --test lazy op_table` rewrites it.

use std::path::Path;

use tch::{Device, Kind, Reduction, Tensor};
use toma::lazy::{lazy, CpuMachine, LazyTensor, Split};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

/// A per-sample activation `[4, ..shape]` that gradients flow through.
fn act(shape: &[i64]) -> LazyTensor {
    let mut full = vec![4];
    full.extend_from_slice(shape);
    let scale = Tensor::ones([1], F32).set_requires_grad(true);
    lazy(&Tensor::randn(full.as_slice(), F32), 0) * LazyTensor::fixed(&scale)
}

/// A parameter.
fn param(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, F32).set_requires_grad(true)
}

/// Per-sample integers below `high`, `[4, ..shape]`.
fn ints(high: i64, shape: &[i64]) -> LazyTensor {
    let mut full = vec![4];
    full.extend_from_slice(shape);
    lazy(&Tensor::randint(high, full.as_slice(), (Kind::Int64, Device::Cpu)), 0)
}

/// The op `name` recorded once on sample operands (the first piece of a split).
fn sample(name: &str) -> Option<LazyTensor> {
    let x = || act(&[6, 5]);
    let img = || act(&[8, 6, 6]);
    let seq = || act(&[8, 10]);
    let y = || ints(5, &[]);
    let mask = || lazy(&Tensor::randn([4, 6, 5], F32).gt(0.0), 0);
    let none = None::<&Tensor>;
    Some(match name {
        "relu" => x().relu(),
        "sigmoid" => x().sigmoid(),
        "tanh" => x().tanh(),
        "exp" => x().exp(),
        "log" => x().abs().log(),
        "neg" => x().neg(),
        "sqrt" => x().abs().sqrt(),
        "abs" => x().abs(),
        "gelu" => x().gelu("none"),
        "silu" => x().silu(),
        "softplus" => x().softplus(),
        "leaky_relu" => x().leaky_relu(),
        "elu" => x().elu(),
        "hardswish" => x().hardswish(),
        "hardsigmoid" => x().hardsigmoid(),
        "relu6" => x().relu6(),
        "sin" => x().sin(),
        "cos" => x().cos(),
        "square" => x().square(),
        "clamp" => x().clamp(-0.5, 0.5),
        "clamp_min" => x().clamp_min(-0.5),
        "clamp_max" => x().clamp_max(0.5),
        "rsqrt" => x().abs().rsqrt(),
        "reciprocal" => x().reciprocal(),
        "erf" => x().erf(),
        "log_sigmoid" => x().log_sigmoid(),
        "detach" => x().detach(),
        "to_device" => x().to_device(Device::Cpu),
        "to" => x().to(Device::Cpu),
        "full_like" => x().full_like(0.5),
        "zeros_like" => x().zeros_like(),
        "ones_like" => x().ones_like(),
        "randn_like" => x().randn_like(),
        "rand_like" => x().rand_like(),
        "bernoulli" => x().sigmoid().bernoulli(),
        "mish" => x().mish(),
        "hardtanh" => x().hardtanh(),
        "selu" => x().selu(),
        "sign" => x().sign(),
        "max_other" => x().max_other(&x()),
        "min_other" => x().min_other(&x()),
        "expand_as" => x().narrow(1, 0, 1).expand_as(&x()),
        "view_as" => x().view([4, 30]).view_as(&x()),
        "reshape_as" => x().transpose(1, 2).reshape_as(&x()),
        "type_as" => x().type_as(&x().to_kind(Kind::Double)),
        "l1_loss" => x().l1_loss(&x().tanh(), Reduction::Mean),
        "masked_fill" => x().masked_fill(&mask(), 0.0),
        "where_self" => x().where_self(&mask(), &x()),
        "tril" => x().tril(0),
        "triu" => x().triu(0),
        "add" => x().add(&x()),
        "sub" => x().sub(&x()),
        "mul" => x().mul(&x()),
        "div" => x().div(&x()),
        "pow" => x().abs().pow(&x()),
        "maximum" => x().maximum(&x()),
        "minimum" => x().minimum(&x()),
        "eq_tensor" => x().eq_tensor(&x()),
        "ne_tensor" => x().ne_tensor(&x()),
        "lt_tensor" => x().lt_tensor(&x()),
        "le_tensor" => x().le_tensor(&x()),
        "gt_tensor" => x().gt_tensor(&x()),
        "ge_tensor" => x().ge_tensor(&x()),
        "add_scalar" => x().add_scalar(1.0),
        "sub_scalar" => x().sub_scalar(1.0),
        "rsub_scalar" => x().rsub_scalar(1.0),
        "mul_scalar" => x().mul_scalar(2.0),
        "div_scalar" => x().div_scalar(2.0),
        "rdiv_scalar" => x().rdiv_scalar(2.0),
        "pow_tensor_scalar" => x().pow_tensor_scalar(2),
        "eq" => x().eq(0.0),
        "ne" => x().ne(0.0),
        "lt" => x().lt(0.0),
        "le" => x().le(0.0),
        "gt" => x().gt(0.0),
        "ge" => x().ge(0.0),
        "dropout" => x().dropout(0.1, true),
        "feature_dropout" => img().feature_dropout(0.1, true),
        "alpha_dropout" => x().alpha_dropout(0.1, true),
        "feature_alpha_dropout" => img().feature_alpha_dropout(0.1, true),
        "softmax" => x().softmax(-1, None),
        "log_softmax" => x().log_softmax(-1, None),
        "sum" => x().sum(None),
        "sum_dim_intlist" => x().sum_dim_intlist([-1], false, None),
        "mean" => x().mean(None),
        "mean_dim" => x().mean_dim([-1], false, None),
        "amax" => x().amax([-1], false),
        "logsumexp" => x().logsumexp([-1], false),
        "glu" => x().glu(1),
        "var" => x().var(true),
        "var_dim" => x().var_dim([-1], true, false),
        "std" => x().std(true),
        "std_dim" => x().std_dim([-1], false, true),
        "cosine_similarity" => x().cosine_similarity(&x(), -1, 1e-8),
        "max" => x().max(),
        "matmul" => x().matmul(&param(&[5, 7])),
        "mm" => x().i((.., 0, ..)).mm(&param(&[5, 7])),
        "outer" => x().i((.., 0, 0)).outer(&param(&[7])),
        "einsum" => LazyTensor::einsum("bij,jk->bik", &[x(), LazyTensor::fixed(&param(&[5, 7]))], None::<i64>),
        "argmax" => x().argmax(-1, false),
        "argmin" => x().argmin(-1, false),
        "cumsum" => x().cumsum(-1, None::<Kind>),
        "cumprod" => x().cumprod(-1, None::<Kind>),
        "sort" => x().sort(-1, false).0,
        "sort_stable" => x().sort_stable(true, -1, false).0,
        "roll" => x().roll([1], [2]),
        "norm" => x().norm(),
        "norm_scalaropt_dim" => x().norm_scalaropt_dim(2.0, [-1], true),
        "normalize" => x().normalize(2.0, -1, 1e-12),
        "topk" => x().topk(2, -1, true, true).0,
        "max_dim" => x().max_dim(-1, false).0,
        "min_dim" => x().min_dim(-1, true).0,
        "one_hot" => ints(5, &[3]).one_hot(5),
        "onehot" => ints(5, &[3]).onehot(5),
        "min" => x().min(),
        "amin" => x().amin(-1, false),
        "accuracy_for_logits" => x().i((.., 0, ..)).accuracy_for_logits(&ints(5, &[])),
        "bmm" => x().bmm(&act(&[5, 3])),
        "linear" => x().linear(&param(&[7, 5]), Some(&param(&[7]))),
        "baddbmm" => act(&[6, 3]).baddbmm(&x(), &act(&[5, 3]), 1.0, 1.0),
        "embedding" => LazyTensor::embedding(&param(&[11, 5]), &ints(11, &[6]), -1, false, false),
        "batch_norm" => img().batch_norm(
            Some(&param(&[8])),
            Some(&param(&[8])),
            &Tensor::zeros([8], F32),
            &Tensor::ones([8], F32),
            false,
            0.1,
            1e-5,
        ),
        "layer_norm" => x().layer_norm([5], Some(&param(&[5])), Some(&param(&[5])), 1e-5, true),
        "group_norm" => img().group_norm(2, Some(&param(&[8])), Some(&param(&[8])), 1e-5, true),
        "rms_norm" => x().rms_norm([5], Some(&param(&[5])), None),
        "scaled_dot_product_attention" => LazyTensor::scaled_dot_product_attention(
            &act(&[2, 6, 4]),
            &act(&[2, 6, 4]),
            &act(&[2, 6, 4]),
            None::<&LazyTensor>,
            0.0,
            true,
            None,
            false,
        ),
        "conv2d" => img().conv2d(&param(&[4, 8, 3, 3]), Some(&param(&[4])), [1], [1], [1], 1),
        "conv1d" => seq().conv1d(&param(&[4, 8, 3]), Some(&param(&[4])), [1], [1], [1], 1),
        "conv3d" => act(&[8, 4, 6, 6]).conv3d(&param(&[4, 8, 3, 3, 3]), Some(&param(&[4])), [1], [1], [1], 1),
        "max_pool3d" => act(&[8, 4, 6, 6]).max_pool3d([2], [2], [0], [1], false),
        "avg_pool3d" => act(&[8, 4, 6, 6]).avg_pool3d([2], [2], [0], false, true, None),
        "conv_transpose2d" => img().conv_transpose2d(&param(&[8, 4, 3, 3]), Some(&param(&[4])), [2], [1], [0], 1, [1]),
        "max_pool2d" => img().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false),
        "max_pool2d_default" => img().max_pool2d_default(2),
        "max_pool1d" => seq().max_pool1d([2], [2], [0], [1], false),
        "avg_pool1d" => seq().avg_pool1d([2], [2], [0], false, true),
        "adaptive_avg_pool1d" => seq().adaptive_avg_pool1d([5]),
        "avg_pool2d_default" => img().avg_pool2d_default(2),
        "avg_pool2d" => img().avg_pool2d([2, 2], [2, 2], [0, 0], false, true, None),
        "adaptive_avg_pool2d" => img().adaptive_avg_pool2d([1, 1]),
        "upsample_nearest2d" => img().upsample_nearest2d([12, 12], None, None),
        "upsample_bilinear2d" => img().upsample_bilinear2d([12, 12], false, None, None),
        "upsample_nearest1d" => seq().upsample_nearest1d([20], None),
        "pixel_shuffle" => img().pixel_shuffle(2),
        "pixel_unshuffle" => img().pixel_unshuffle(2),
        "unfold" => x().unfold(2, 2, 1),
        "view" => x().view([4, 30]),
        "reshape" => x().transpose(1, 2).reshape([4, 30]),
        "flatten" => x().flatten(1, -1),
        "transpose" => x().transpose(1, 2),
        "permute" => x().permute([0, 2, 1]),
        "unsqueeze" => x().unsqueeze(1),
        "squeeze" => act(&[1, 5]).squeeze(),
        "squeeze_dim" => act(&[1, 5]).squeeze_dim(1),
        "narrow" => x().narrow(2, 1, 3),
        "slice" => x().slice(2, 1, -1, 1),
        "tr" => x().i((.., 0, ..)).tr(),
        "copy" => x().copy(),
        "stack" => LazyTensor::stack(&[x(), x()], 1),
        "chunk" => x().chunk(2, 1).swap_remove(0),
        "split" => x().split(2, 1).swap_remove(0),
        "expand" => act(&[1, 5]).expand([4, 6, 5], false),
        "flip" => x().flip([-1]),
        "repeat" => x().repeat([1, 1, 2]),
        "index_select" => x().index_select(2, &Tensor::from_slice(&[0i64, 2])),
        "gather" => x().gather(2, &ints(5, &[6, 2]), false),
        "scatter" => x().scatter(2, &ints(5, &[6, 2]), &x()),
        "scatter_add" => x().scatter_add(2, &ints(5, &[6, 2]), &x().narrow(2, 0, 2)),
        "index_add" => x().index_add(2, &Tensor::from_slice(&[0i64, 2]), &x().narrow(2, 0, 2)),
        "masked_scatter" => x().masked_scatter(&mask(), &param(&[120])),
        "index_put" => x().index_put(&[None, None, Some(&Tensor::from_slice(&[0i64, 2]))], &x().narrow(2, 0, 2), false),
        "select" => x().select(1, 0),
        "pad" => img().pad([1, 1, 1, 1], "reflect", None),
        "constant_pad_nd" => img().constant_pad_nd([1, 1, 1, 1]),
        "flat_view" => x().flat_view(),
        "to_kind" => x().to_kind(Kind::Double),
        "contiguous" => x().transpose(1, 2).contiguous(),
        "cat" => LazyTensor::cat(&[x(), x()], 2),
        "cross_entropy_for_logits" => act(&[5]).cross_entropy_for_logits(&y()),
        "cross_entropy_loss" => act(&[5]).cross_entropy_loss(&y(), none, Reduction::Mean, -100, 0.1),
        "kl_div" => act(&[5]).log_softmax(-1, None).kl_div(&act(&[5]).softmax(-1, None), Reduction::Mean, false),
        "nll_loss" => act(&[5]).log_softmax(-1, None).nll_loss(&y()),
        "g_nll_loss" => {
            act(&[5]).log_softmax(-1, None).g_nll_loss(&y(), Some(&Tensor::ones([5], F32)), Reduction::Sum, -100)
        }
        "mse_loss" => x().mse_loss(&x(), Reduction::Mean),
        "binary_cross_entropy_with_logits" => {
            x().binary_cross_entropy_with_logits(&x().sigmoid(), None::<&Tensor>, None::<&Tensor>, Reduction::Mean)
        }
        "smooth_l1_loss" => x().smooth_l1_loss(&x(), Reduction::Mean, 1.0),
        "huber_loss" => x().huber_loss(&x(), Reduction::Mean, 1.0),
        "cosine_embedding_loss" => {
            LazyTensor::cosine_embedding_loss(&act(&[5]), &act(&[5]), &ints(2, &[]), 0.1, Reduction::Mean)
        }
        "margin_ranking_loss" => LazyTensor::margin_ranking_loss(&x(), &x(), &x(), 0.1, Reduction::Mean),
        "triplet_margin_loss" => {
            LazyTensor::triplet_margin_loss(&x(), &x(), &x(), 1.0, 2.0, 1e-6, false, Reduction::Mean)
        }
        "binary_cross_entropy" => x().sigmoid().binary_cross_entropy(&x().sigmoid(), none, Reduction::Mean),
        "poisson_nll_loss" => x().poisson_nll_loss(&x().exp(), true, false, 1e-8, Reduction::Mean),
        "ctc_loss" => {
            let lp = act(&[6, 5]).transpose(0, 1).log_softmax(2, None);
            LazyTensor::ctc_loss(&lp, &ints(5, &[2]), [6; 4], [2; 4], 0, Reduction::Mean, false)
        }
        "ctc_loss_tensor" => {
            let lp = act(&[6, 5]).transpose(0, 1).log_softmax(2, None);
            let lengths = |l: i64| lazy(&Tensor::full([4], l, (Kind::Int64, Device::Cpu)), 0);
            LazyTensor::ctc_loss_tensor(&lp, &ints(5, &[2]), &lengths(6), &lengths(2), 0, Reduction::Mean, false)
        }
        _ => return None,
    })
}

/// Why op `name` is refused when recorded, for the ops that always are (an output whose shape
/// depends on the values).
fn refusal(name: &str) -> Option<toma::lazy::LazyError> {
    match name {
        "nonzero" => act(&[6, 5]).f_nonzero().err(),
        "argwhere" => act(&[6, 5]).f_argwhere().err(),
        _ => None,
    }
}

/// The two generated columns of `name`: how micro-batches treat it, and what the planner charges
/// it (relative to its output's bytes, or its first operand's).
fn costs(name: &str) -> (String, String) {
    if let Some(toma::lazy::LazyError::Unsupported { .. }) = refusal(name) {
        return ("refused when recorded: its shape depends on the values".into(), "none".into());
    }
    let value = sample(name).unwrap_or_else(|| {
        panic!("op `{name}` has no sample in tests/lazy/op_table.rs: add one to `sample` (its recorded costs go in docs/ops.md)")
    });
    let c = value.op_costs_on(&CpuMachine::rules_read_on());
    let split = match &c.split {
        Split::PerSample => "per sample".to_string(),
        Split::Summed => "summed (weighted by share)".to_string(),
        Split::Maximum => "maximum".to_string(),
        Split::Fixed => "fixed".to_string(),
        Split::Mixes(reason) => format!("refused: {reason}"),
        other => format!("{other:?}"),
    };
    // Sizes relative to the first operand (for most ops, the activation they work on).
    let unit = c.operands.first().copied().unwrap_or(c.output).max(1) as f64;
    let ratio = |bytes: u64| {
        let r = bytes as f64 / unit;
        if bytes == 0 {
            "0".to_string()
        } else if r < 0.01 {
            "<0.01".to_string()
        } else if r >= 0.5 && (r - r.round()).abs() < 0.05 {
            format!("{}", r.round())
        } else {
            format!("{r:.2}")
        }
    };
    let mut memory = Vec::new();
    memory.push(if c.output == 0 { "a view".to_string() } else { format!("output {}×", ratio(c.output)) });
    let mut kept: Vec<String> = c.saved_inputs.iter().map(|k| format!("operand {k}")).collect();
    if c.saves_output {
        kept.push("output".into());
    }
    if c.saved_extra > 0 {
        kept.push(format!("{}× more", ratio(c.saved_extra)));
    }
    if !kept.is_empty() {
        memory.push(format!("keeps {}", kept.join(", ")));
    }
    if c.scratch > 0 || c.backward_scratch > 0 {
        memory.push(format!("scratch {}× / {}×", ratio(c.scratch), ratio(c.backward_scratch)));
    }
    (split, memory.join("; "))
}

/// The rows of one family file: (op, first documentation line).
fn ops_of(source: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = source.lines().collect();
    let mut rows = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix("pub fn f_") else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // The doc block right above (attributes may sit between).
        let mut j = i;
        while j > 0 && lines[j - 1].trim_start().starts_with("#[") {
            j -= 1;
        }
        while j > 0 && lines[j - 1].trim_start().starts_with("///") {
            j -= 1;
        }
        // The first paragraph, up to its first sentence.
        let mut paragraph = String::new();
        for line in &lines[j..i] {
            let text = line.trim_start().trim_start_matches("///").trim();
            if text.is_empty() || text.starts_with('#') {
                break;
            }
            if !paragraph.is_empty() {
                paragraph.push(' ');
            }
            paragraph.push_str(text);
        }
        let sentence = match paragraph.find(". ") {
            Some(end) => paragraph[..=end].to_string(),
            None => paragraph,
        };
        rows.push((name, plain(&sentence).replace('|', "\\|")));
    }
    rows
}

/// Markdown links `[text](target)` as their text.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|k| open + k) else { break };
        let Some(end) = rest[close..].find(')').map(|k| close + k) else { break };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

fn table() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lazy/ops");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut out = format!(
        "# Ops `toma::lazy` records\n\nGenerated from `src/lazy/ops/*.rs` by `tests/lazy/op_table.rs` \
         (`TOMA_WRITE_OP_TABLE=1 cargo test --test lazy op_table`); CI fails when it differs from the code. \
         Each op also has a panicking form without `f_`, as in tch. Its file holds all its rules: how it is \
         recorded, run on a micro-batch, what its memory costs, and how a split rewrites it; its documentation \
         says when it mixes samples (and a split is refused). The two middle columns are read from each op \
         recorded once on small sample operands (`LazyTensor::op_costs_on`): how micro-batches treat its value, and \
         what the planner charges it: its output, what autograd keeps for the backward (operands by \
         position, from 0; the output; more), and scratch space forward / backward, sized relative to the \
         op's first operand (on the CPU, in `Float`), as the rules price them for the machine they were read on \
         (`CpuMachine::rules_read_on()`: {machine}), whatever machine generates this page.\n\n\
         | op | family | micro-batches | memory (planned) | what it computes |\n|---|---|---|---|---|\n",
        machine = CpuMachine::rules_read_on()
    );
    for file in files {
        let family = file.file_stem().unwrap().to_string_lossy().into_owned();
        for (name, summary) in ops_of(&std::fs::read_to_string(&file).unwrap()) {
            let (split, memory) = costs(&name);
            out.push_str(&format!(
                "| `{name}` | {family} | {} | {} | {summary} |\n",
                split.replace('|', "\\|"),
                memory
            ));
        }
    }
    // The layers: every `impl LazyModule(T) for ..` in src/lazy, and the models written once.
    out.push_str(
        "\n## Layers\n\nWhat `LazyTensor::apply` / `apply_t` take (from the `impl LazyModule for` and \
         `impl LazyModuleT for` lines of `src/lazy/*.rs`, and the models' `both_modules!` lists), and the \
         recurrent layers of `toma::lazy::nn` (`recurrent_layer!`), whose `seq`, `seq_init` and `step` take a \
         `LazyTensor`; each records the ops above, so its micro-batch rule and memory are theirs, except a \
         recurrent layer's `seq` and `seq_init`: one `lstm` or `gru` op on libtorch's fused kernel (`ops/recurrent.rs`), \
         per sample (a recurrence mixes time steps, not samples), its memory measured by calibration, and a GRU's \
         `step` (one layer, one direction, batch first, outside autocast): one `gru_cell` op, libtorch's cell, \
         measured so too.\n\n| layer | file |\n|---|---|\n",
    );
    let lazy_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lazy");
    let mut files: Vec<_> =
        std::fs::read_dir(&lazy_dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
    files.sort();
    for file in files {
        let source = std::fs::read_to_string(&file).unwrap();
        let stem = file.file_name().unwrap().to_string_lossy().into_owned();
        let lines: Vec<&str> = source.lines().collect();
        for (at, line) in lines.iter().enumerate() {
            // `recurrent_layer!(` takes its doc lines, then the layer's type.
            if *line == "recurrent_layer!(" {
                if let Some(name) = lines[at + 1..].iter().map(|l| l.trim()).find(|l| !l.starts_with("///")) {
                    let name = name.trim_end_matches(',');
                    out.push_str(&format!(
                        "| `{name}` (its `RNN<LazyTensor>`: a sequence one fused op, `step` recorded from small ops) | `src/lazy/{stem}` |\n"
                    ));
                }
                continue;
            }
            let layer = ["impl LazyModule for ", "impl LazyModuleT for "]
                .iter()
                .find_map(|prefix| line.strip_prefix(prefix))
                .map(|rest| rest.trim_end_matches(" {").to_string());
            let listed =
                line.trim_start().strip_prefix("both_modules!(").map(|rest| rest.trim_end_matches(");").to_string());
            for name in layer
                .into_iter()
                .chain(listed.into_iter().flat_map(|l| l.split(", ").map(str::to_string).collect::<Vec<_>>()))
            {
                out.push_str(&format!("| `{name}` | `src/lazy/{stem}` |\n"));
            }
        }
    }
    out
}

#[test]
fn the_op_table_is_the_codes() {
    let generated = table();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ops.md");
    if std::env::var_os("TOMA_WRITE_OP_TABLE").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "docs/ops.md differs from the ops in src/lazy/ops; regenerate it: TOMA_WRITE_OP_TABLE=1 cargo test --test lazy op_table"
    );
    assert!(generated.matches("\n| `").count() >= 60, "{generated}");
}
