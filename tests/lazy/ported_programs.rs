//! More of tch-rs's programs (tch-rs `a1dc7ec`), written in their idioms as our own code with
//! synthetic data and small sizes, and ported as `docs/porting.md` says: the `use` lines switch
//! `tch::nn` to `toma::lazy::nn`, `#[toma::lazy::module]` goes on each custom `fn` or `impl`, and
//! the step's tensors are wrapped with `lazy(..)`. Each trains both ways from one seed to the
//! same losses and weights.
//!
//! - **neural-style-transfer**: a frozen feature stack read layer by layer
//!   (`forward_all_t`), Gram matrices of a recorded map against fixed targets (a free `fn`
//!   taking a lazy value and a `Tensor`), losses summed with `.iter().map(..).sum()`, and the
//!   image itself as the one variable (`var_copy`), wrapped with no batch dimension.
//! - **policy-gradient**: an action mask built with `scatter_value`, returns from a
//!   `Vec<f64>`, observations stacked from a `Vec<Tensor>`, split in micro-batches.
//! - **ddpg**: an actor and a critic, each with its own `VarStore` and optimizer, target
//!   networks behind `detach`, `Tensor::cat` of `.copy()`s, `zero_grad` / `backward` / `step`
//!   by hand, and the actor's loss flowing back through the critic (whose gradients it adds to).
//! - **mnist_linear**: weights that are plain tensors requiring gradients, `zero_grad()` in
//!   place, `backward()`, and an update by hand under `no_grad`.
//! - **transfer-learning**: a ResNet-18 without its last layer, the features computed once
//!   under `no_grad` (lazily, in micro-batches), a linear head trained on them.
//! - **custom-optimizer**: an optimizer of its own over the store's `variables_`, stepping on
//!   the `.grad()` a lazy `backward()` left.

use tch::kind::FLOAT_CPU;
use tch::{Device, Kind, Tensor};
use toma::lazy::nn::{self, Module, OptimizerConfig};
use toma::lazy::{lazy, vision, LazyTensor, Options};

fn same(what: &str, lazily: &[f64], eagerly: &[f64], tolerance: f64) {
    assert_eq!(lazily.len(), eagerly.len(), "{what}");
    for (step, (a, b)) in lazily.iter().zip(eagerly).enumerate() {
        assert!((a - b).abs() <= tolerance * b.abs().max(1.0), "{what} #{step}: {a} lazily, {b} eagerly");
    }
}

fn weights(vs: &nn::VarStore) -> Vec<f64> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.iter().map(|(_, v)| v.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[])).collect()
}

// --- neural-style-transfer -------------------------------------------------------------------

const STYLE_WEIGHT: f64 = 1e6;
const STYLE_INDEXES: [usize; 3] = [0, 2, 5];
const CONTENT_INDEXES: [usize; 1] = [5];

#[toma::lazy::module]
fn gram_matrix(m: &Tensor) -> Tensor {
    let (a, b, c, d) = m.size4().unwrap();
    let m = m.view([a * b, c * d]);
    let g = m.matmul(&m.tr());
    g / (a * b * c * d)
}

#[toma::lazy::module]
fn style_loss(m1: &Tensor, m2: &Tensor) -> Tensor {
    gram_matrix(m1).mse_loss(&gram_matrix(m2), tch::Reduction::Mean)
}

/// The first layers of a VGG, as tch's `vgg16` lays them out (a convolution, its ReLU, ..).
fn features(p: &nn::Path) -> nn::SequentialT {
    let c = nn::ConvConfig { padding: 1, ..Default::default() };
    nn::seq_t()
        .add(nn::conv2d(p / "0", 3, 8, 3, c))
        .add_fn(|xs| xs.relu())
        .add(nn::conv2d(p / "2", 8, 8, 3, c))
        .add_fn(|xs| xs.relu())
        .add_fn(|xs| xs.max_pool2d_default(2))
        .add(nn::conv2d(p / "5", 8, 16, 3, c))
        .add_fn(|xs| xs.relu())
}

/// The frozen network, the style and content images: the same for both runs (tests run in
/// threads that draw from one generator, so nothing here hangs on a seed).
struct Style {
    net: nn::SequentialT,
    style_img: Tensor,
    content_img: Tensor,
    _net_vs: nn::VarStore,
}

fn style_inputs() -> Style {
    let mut net_vs = nn::VarStore::new(Device::Cpu);
    let net = features(&net_vs.root());
    net_vs.freeze();
    let style_img = Tensor::rand([1, 3, 24, 24], FLOAT_CPU);
    let content_img = Tensor::rand([1, 3, 24, 24], FLOAT_CPU);
    Style { net, style_img, content_img, _net_vs: net_vs }
}

fn style_transfer(inputs: &Style, lazily: bool) -> (Vec<f64>, Vec<f64>) {
    let Style { net, style_img, content_img, .. } = inputs;
    let device = Device::Cpu;
    let max_layer = STYLE_INDEXES.iter().max().unwrap() + 1;
    let style_layers = net.forward_all_t(style_img, false, Some(max_layer));
    let content_layers = net.forward_all_t(content_img, false, Some(max_layer));
    let vs = nn::VarStore::new(device);
    let input_var = vs.root().var_copy("img", content_img);
    let mut opt = nn::Adam::default().build(&vs, 1e-1).unwrap();
    let mut losses = vec![];
    for _ in 0..3 {
        let loss = if lazily {
            let input_var = lazy(&input_var, None);
            let input_layers = net.forward_all_t(&input_var, false, Some(max_layer));
            let style_loss: LazyTensor =
                STYLE_INDEXES.iter().map(|&i| style_loss(&input_layers[i], &style_layers[i])).sum();
            let content_loss: LazyTensor = CONTENT_INDEXES
                .iter()
                .map(|&i| input_layers[i].mse_loss(&content_layers[i], tch::Reduction::Mean))
                .sum();
            let loss = style_loss * STYLE_WEIGHT + content_loss;
            opt.backward_step(&loss);
            f64::try_from(loss).unwrap()
        } else {
            let input_layers = net.forward_all_t(&input_var, false, Some(max_layer));
            let style_loss: Tensor =
                STYLE_INDEXES.iter().map(|&i| style_loss(&input_layers[i], &style_layers[i])).sum();
            let content_loss: Tensor = CONTENT_INDEXES
                .iter()
                .map(|&i| input_layers[i].mse_loss(&content_layers[i], tch::Reduction::Mean))
                .sum();
            let loss = style_loss * STYLE_WEIGHT + content_loss;
            opt.backward_step(&loss);
            f64::try_from(loss).unwrap()
        };
        losses.push(loss);
    }
    (losses, weights(&vs))
}

#[test]
fn tchs_style_transfer_ports_and_optimizes_the_image_as_eagerly() {
    let inputs = style_inputs();
    let (lazy_losses, lazy_image) = style_transfer(&inputs, true);
    let (eager_losses, eager_image) = style_transfer(&inputs, false);
    same("style transfer losses", &lazy_losses, &eager_losses, 1e-5);
    same("style transfer image", &lazy_image, &eager_image, 1e-5);
}

/// A `fn` with the attribute takes a lazy value and fixed `Tensor`s after it: recorded, in a
/// closure run on a `Tensor` (each op at once), and on tensors alone, the same value.
#[test]
fn later_tensor_arguments_may_be_fixed_tensors() {
    let x = Tensor::rand([1, 4, 6, 6], FLOAT_CPU);
    let target = Tensor::rand([1, 4, 6, 6], FLOAT_CPU);
    let expected = style_loss(&x, &target);
    let recorded = style_loss(&lazy(&x, None), &target).to_tensor().unwrap();
    assert!(recorded.allclose(&expected, 1e-6, 1e-6, false));
    let t = target.shallow_clone();
    let layer = nn::func(move |xs| style_loss(xs, &t));
    let at_once = nn::Module::forward(&layer, &x);
    assert!(at_once.allclose(&expected, 1e-6, 1e-6, false));
    let through = lazy(&x, None).apply(&layer).to_tensor().unwrap();
    assert!(through.allclose(&expected, 1e-6, 1e-6, false));
}

/// tch's `forward_all_t` on toma's sequence, on a `Tensor` and recorded, against tch's own
/// `SequentialT` on the same layers: every output, `n` past the end, and `Some(0)` (the first
/// layer runs whatever `n` is).
#[test]
fn forward_all_t_gives_tchs_outputs_on_either_kind() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = features(&vs.root());
    let c = nn::ConvConfig { padding: 1, ..Default::default() };
    // tch's own, under the same names, with the same weights.
    let mut their_vs = nn::VarStore::new(Device::Cpu);
    let p = their_vs.root();
    let theirs = tch::nn::seq_t()
        .add(tch::nn::conv2d(&p / "0", 3, 8, 3, c))
        .add_fn(|xs| xs.relu())
        .add(tch::nn::conv2d(&p / "2", 8, 8, 3, c))
        .add_fn(|xs| xs.relu())
        .add_fn(|xs| xs.max_pool2d_default(2))
        .add(tch::nn::conv2d(&p / "5", 8, 16, 3, c))
        .add_fn(|xs| xs.relu());
    their_vs.copy(&vs).unwrap();
    let image = Tensor::rand([2, 3, 12, 12], FLOAT_CPU);
    for n in [None, Some(0), Some(3), Some(40)] {
        let expected = theirs.forward_all_t(&image, false, n);
        let eager = ours.forward_all_t(&image, false, n);
        let recorded = ours.forward_all_t(&lazy(&image, 0), false, n);
        assert_eq!((eager.len(), recorded.len()), (expected.len(), expected.len()), "n = {n:?}");
        for (i, e) in expected.iter().enumerate() {
            assert!(eager[i].allclose(e, 1e-6, 1e-6, false), "layer {i}, n = {n:?}");
            let value = recorded[i].to_tensor_with(&Options::new().micro_batch(1)).unwrap();
            assert!(value.allclose(e, 1e-5, 1e-5, false), "layer {i} recorded, n = {n:?}");
        }
    }
    let empty = nn::seq_t();
    assert_eq!(empty.forward_all_t(&image, false, None).len(), 1, "an empty sequence gives its input");
}

/// `toma::lazy::vision`'s VGG reads its layers as tch's `SequentialT` does, by the same
/// indexes: style transfer's `[0, 2, 5, 7, 10]` are convolutions' outputs, before their ReLU.
#[test]
fn a_vggs_layers_are_read_by_tchs_indexes() {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = toma::lazy::vision::vgg11(&vs.root(), 10);
    let image = Tensor::rand([1, 3, 32, 32], FLOAT_CPU);
    let layers = net.forward_all_t(&image, false, Some(11));
    assert_eq!(layers.len(), 11);
    // vgg11: conv 0, relu 1, pool 2, conv 3, relu 4, pool 5, conv 6, relu 7, conv 8, relu 9, pool 10.
    let conv = |name: &str, x: &Tensor| {
        let ws = vs.variables()[&format!("features.{name}.weight")].shallow_clone();
        let bs = vs.variables()[&format!("features.{name}.bias")].shallow_clone();
        x.conv2d(&ws, Some(&bs), [1, 1], [1, 1], [1, 1], 1)
    };
    assert!(layers[0].allclose(&conv("0", &image), 1e-6, 1e-6, false));
    assert!(layers[1].allclose(&layers[0].relu(), 0.0, 0.0, false));
    assert_eq!(layers[2].size(), [1, 64, 16, 16]);
    assert!(layers[3].allclose(&conv("3", &layers[2]), 1e-5, 1e-5, false));
    assert_eq!(layers[10].size(), [1, 256, 4, 4]);
    let recorded = net.forward_all_t(&lazy(&image, 0), false, Some(11));
    assert!(recorded[8].to_tensor().unwrap().allclose(&layers[8], 1e-5, 1e-5, false));
    let all = net.forward_all_t(&Tensor::rand([1, 3, 224, 224], FLOAT_CPU), false, None);
    assert_eq!(all.last().unwrap().size(), [1, 10], "the last is the classifier's");
}

// --- policy-gradient -------------------------------------------------------------------------

fn policy(p: &nn::Path, nin: i64, nact: i64) -> impl nn::Module + use<> {
    nn::seq().add(nn::linear(p / "lin1", nin, 32, Default::default())).add_fn(|xs| xs.tanh()).add(nn::linear(
        p / "lin2",
        32,
        nact,
        Default::default(),
    ))
}

fn accumulate_rewards(rewards: &[f64], done: &[bool]) -> Vec<f64> {
    let mut acc = 0.0;
    let mut out = rewards.to_vec();
    for (i, r) in out.iter_mut().enumerate().rev() {
        if done[i] {
            acc = 0.0;
        }
        acc += *r;
        *r = acc;
    }
    out
}

/// One epoch's rollout: observations one by one, the actions taken, their returns.
struct Rollout {
    obs: Vec<Tensor>,
    actions: Tensor,
    returns: Vec<f64>,
}

fn rollouts() -> Vec<Rollout> {
    (0..3)
        .map(|epoch| {
            let batch_size = 37 + epoch;
            let rewards: Vec<f64> = (0..batch_size).map(|i| ((i * 7) % 5) as f64 / 5.0).collect();
            let done: Vec<bool> = (0..batch_size).map(|i| i % 9 == 8).collect();
            Rollout {
                obs: (0..batch_size).map(|_| Tensor::randn([4], FLOAT_CPU)).collect(),
                actions: Tensor::randint(2, [batch_size as i64], tch::kind::INT64_CPU),
                returns: accumulate_rewards(&rewards, &done),
            }
        })
        .collect()
}

fn policy_gradient(start: &nn::VarStore, rollouts: &[Rollout], micro_batch: Option<usize>) -> (Vec<f64>, Vec<f64>) {
    use tch::Kind::Float;
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = policy(&vs.root(), 4, 2);
    vs.copy(start).unwrap();
    let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
    let mut losses = vec![];
    for rollout in rollouts {
        let batch_size = rollout.obs.len() as i64;
        let actions = rollout.actions.unsqueeze(1);
        let rewards = Tensor::from_slice(&rollout.returns).to_kind(Float);
        let action_mask = Tensor::zeros([batch_size, 2], FLOAT_CPU).scatter_value(1, &actions, 1.0);
        let obs = &rollout.obs;
        let loss = match micro_batch {
            Some(size) => {
                let (obs, action_mask, rewards) = lazy((&Tensor::stack(obs, 0), &action_mask, &rewards), 0);
                let logits = obs.apply(&model);
                let log_probs = (action_mask * logits.log_softmax(1, Float)).sum_dim_intlist(1, false, Float);
                let loss = -(rewards * log_probs).mean(Float);
                opt.f_backward_step_with(&loss, &Options::new().micro_batch(size)).unwrap();
                f64::try_from(loss).unwrap()
            }
            None => {
                let logits = Tensor::stack(obs, 0).apply(&model);
                let log_probs = (action_mask * logits.log_softmax(1, Float)).sum_dim_intlist(1, false, Float);
                let loss = -(rewards * log_probs).mean(Float);
                opt.backward_step(&loss);
                f64::try_from(loss).unwrap()
            }
        };
        losses.push(loss);
    }
    (losses, weights(&vs))
}

#[test]
fn tchs_policy_gradient_ports_and_trains_in_uneven_micro_batches() {
    let start = nn::VarStore::new(Device::Cpu);
    let _ = policy(&start.root(), 4, 2);
    let rollouts = rollouts();
    let (eager_losses, eager_weights) = policy_gradient(&start, &rollouts, None);
    for size in [37, 10] {
        let (losses, weights) = policy_gradient(&start, &rollouts, Some(size));
        same(&format!("policy gradient losses, micro-batch {size}"), &losses, &eager_losses, 1e-5);
        same(&format!("policy gradient weights, micro-batch {size}"), &weights, &eager_weights, 1e-5);
    }
}

// --- ddpg ------------------------------------------------------------------------------------

struct Actor {
    var_store: nn::VarStore,
    network: nn::Sequential,
    device: Device,
    opt: nn::Optimizer,
}

#[toma::lazy::module]
impl Actor {
    fn new(num_obs: i64, num_actions: i64, learning_rate: f64) -> Self {
        let var_store = nn::VarStore::new(Device::Cpu);
        let opt = nn::Adam::default().build(&var_store, learning_rate).unwrap();
        let p = &var_store.root();
        Self {
            network: nn::seq()
                .add(nn::linear(p / "al1", num_obs, 40, Default::default()))
                .add_fn(|xs| xs.relu())
                .add(nn::linear(p / "al2", 40, 30, Default::default()))
                .add_fn(|xs| xs.relu())
                .add(nn::linear(p / "al3", 30, num_actions, Default::default()))
                .add_fn(|xs| xs.tanh()),
            device: p.device(),
            var_store,
            opt,
        }
    }

    fn forward(&self, obs: &Tensor) -> Tensor {
        obs.to_device(self.device).apply(&self.network)
    }
}

struct Critic {
    var_store: nn::VarStore,
    network: nn::Sequential,
    device: Device,
    opt: nn::Optimizer,
}

#[toma::lazy::module]
impl Critic {
    fn new(num_obs: i64, num_actions: i64) -> Self {
        let var_store = nn::VarStore::new(Device::Cpu);
        let opt = nn::Adam::default().build(&var_store, 1e-3).unwrap();
        let p = &var_store.root();
        Self {
            network: nn::seq()
                .add(nn::linear(p / "cl1", num_obs + num_actions, 40, Default::default()))
                .add_fn(|xs| xs.relu())
                .add(nn::linear(p / "cl2", 40, 30, Default::default()))
                .add_fn(|xs| xs.relu())
                .add(nn::linear(p / "cl3", 30, 1, Default::default())),
            device: p.device(),
            var_store,
            opt,
        }
    }

    fn forward(&self, obs: &Tensor, actions: &Tensor) -> Tensor {
        let xs = Tensor::cat(&[actions.copy(), obs.copy()], 1);
        xs.to_device(self.device).apply(&self.network)
    }
}

fn track(dest: &mut nn::VarStore, src: &nn::VarStore, tau: f64) {
    tch::no_grad(|| {
        for (dest, src) in dest.trainable_variables().iter_mut().zip(src.trainable_variables().iter()) {
            dest.copy_(&(tau * src + (1.0 - tau) * &*dest));
        }
    })
}

const NUM_OBS: i64 = 3;
const NUM_ACTIONS: i64 = 1;

/// `start`: an actor and a critic to start from; `batches`: states, actions, rewards and next
/// states, as the replay buffer samples them.
fn ddpg(start: &(Actor, Critic), batches: &[[Tensor; 4]], lazily: bool) -> Vec<f64> {
    use tch::Kind::Float;
    let (num_obs, num_actions) = (NUM_OBS, NUM_ACTIONS);
    let mut actor = Actor::new(num_obs, num_actions, 1e-4);
    actor.var_store.copy(&start.0.var_store).unwrap();
    let mut critic = Critic::new(num_obs, num_actions);
    critic.var_store.copy(&start.1.var_store).unwrap();
    let mut actor_target = Actor::new(num_obs, num_actions, 1e-4);
    actor_target.var_store.copy(&actor.var_store).unwrap();
    let mut critic_target = Critic::new(num_obs, num_actions);
    critic_target.var_store.copy(&critic.var_store).unwrap();
    let gamma = 0.99;
    let mut out = vec![];
    for batch in batches {
        let [states, actions, rewards, next_states] = batch.each_ref().map(Tensor::shallow_clone);
        if lazily {
            let (states, actions, rewards, next_states) = lazy((&states, &actions, &rewards, &next_states), 0);
            let mut q_target = critic_target.forward(&next_states, &actor_target.forward(&next_states));
            q_target = rewards + (gamma * q_target).detach();
            let q = critic.forward(&states, &actions);
            let diff = q_target - q;
            let critic_loss = (&diff * &diff).mean(Float);
            critic.opt.zero_grad();
            critic_loss.backward().unwrap();
            critic.opt.step();
            let actor_loss = -critic.forward(&states, &actor.forward(&states)).mean(Float);
            actor.opt.zero_grad();
            actor_loss.backward().unwrap();
            actor.opt.step();
            out.extend([f64::try_from(&critic_loss).unwrap(), f64::try_from(&actor_loss).unwrap()]);
        } else {
            let mut q_target = critic_target.forward(&next_states, &actor_target.forward(&next_states));
            q_target = rewards + (gamma * q_target).detach();
            let q = critic.forward(&states, &actions);
            let diff = q_target - q;
            let critic_loss = (&diff * &diff).mean(Float);
            critic.opt.zero_grad();
            critic_loss.backward();
            critic.opt.step();
            let actor_loss = -critic.forward(&states, &actor.forward(&states)).mean(Float);
            actor.opt.zero_grad();
            actor_loss.backward();
            actor.opt.step();
            out.extend([f64::try_from(&critic_loss).unwrap(), f64::try_from(&actor_loss).unwrap()]);
        }
        track(&mut critic_target.var_store, &critic.var_store, 0.005);
        track(&mut actor_target.var_store, &actor.var_store, 0.005);
    }
    // The critic's gradients hold the actor's loss's contribution, added to its own.
    let grads: f64 =
        critic.var_store.trainable_variables().iter().map(|v| v.grad().abs().sum(Kind::Double).double_value(&[])).sum();
    out.push(grads);
    out.extend(weights(&critic.var_store));
    out.extend(weights(&actor.var_store));
    out
}

#[test]
fn tchs_ddpg_ports_with_its_targets_and_two_optimizers() {
    let start = (Actor::new(NUM_OBS, NUM_ACTIONS, 1e-4), Critic::new(NUM_OBS, NUM_ACTIONS));
    let batches: Vec<[Tensor; 4]> =
        (0..3).map(|_| [NUM_OBS, NUM_ACTIONS, 1, NUM_OBS].map(|w| Tensor::randn([100, w], FLOAT_CPU))).collect();
    same("ddpg", &ddpg(&start, &batches, true), &ddpg(&start, &batches, false), 1e-6);
}

// --- mnist_linear and a custom optimizer ----------------------------------------------------

/// tch-rs's `mnist_linear`: its weights are tensors of its own (`set_requires_grad(true)`, no
/// `VarStore`), zeroed in place with `zero_grad()` before each `backward()`, and updated by hand
/// under `no_grad`, as its `custom-optimizer` example's `step` reads `.grad()` too. Lazily the
/// step runs in micro-batches, its gradients added into the zeroed `.grad`.
fn mnist_linear(images: &Tensor, labels: &Tensor, micro_batch: Option<usize>) -> Vec<f64> {
    const IMAGE_DIM: i64 = 784;
    const LABELS: i64 = 10;
    let mut ws = Tensor::zeros([IMAGE_DIM, LABELS], FLOAT_CPU).set_requires_grad(true);
    let mut bs = Tensor::zeros([LABELS], FLOAT_CPU).set_requires_grad(true);
    let mut out = vec![];
    for _epoch in 1..5 {
        let loss = match micro_batch {
            Some(size) => {
                let (images, labels) = lazy((images, labels), 0);
                let logits = images.mm(&ws) + &bs;
                let loss = logits.log_softmax(-1, Kind::Float).nll_loss(&labels);
                ws.zero_grad();
                bs.zero_grad();
                loss.backward_with(&Options::new().micro_batch(size)).unwrap();
                loss.double_value(&[])
            }
            None => {
                let logits = images.mm(&ws) + &bs;
                let loss = logits.log_softmax(-1, Kind::Float).nll_loss(labels);
                ws.zero_grad();
                bs.zero_grad();
                loss.backward();
                loss.double_value(&[])
            }
        };
        tch::no_grad(|| {
            ws += ws.grad() * (-1);
            bs += bs.grad() * (-1);
        });
        out.push(loss);
    }
    out.push(ws.square().sum(Kind::Double).double_value(&[]));
    out.push(bs.square().sum(Kind::Double).double_value(&[]));
    out
}

#[test]
fn tchs_mnist_linear_ports_with_its_own_weights_and_update() {
    let images = Tensor::rand([300, 784], FLOAT_CPU);
    let labels = Tensor::randint(10, [300], tch::kind::INT64_CPU);
    let eager = mnist_linear(&images, &labels, None);
    for size in [300, 128] {
        same(&format!("mnist_linear, micro-batch {size}"), &mnist_linear(&images, &labels, Some(size)), &eager, 1e-5);
    }
}

/// DQN's target, as it is usually written: the target network's estimate recorded under
/// `tch::no_grad`. Eagerly that value has no `grad_fn`; lazily it is recorded detached, so no
/// gradient reaches the target network and the online network's gradients are the eager ones,
/// whole and in micro-batches of 5 (of 12).
#[test]
fn a_target_recorded_under_no_grad_gets_no_gradient() {
    let online_vs = nn::VarStore::new(Device::Cpu);
    let target_vs = nn::VarStore::new(Device::Cpu);
    let online = nn::linear(online_vs.root() / "q", 6, 3, Default::default());
    let target = nn::linear(target_vs.root() / "q", 6, 3, Default::default());
    let (obs, next_obs) = (Tensor::randn([12, 6], FLOAT_CPU), Tensor::randn([12, 6], FLOAT_CPU));
    let actions = Tensor::randint(3, [12, 1], tch::kind::INT64_CPU);
    let rewards = Tensor::randn([12], FLOAT_CPU);
    let loss_of = |obs: &LazyTensor, next_obs: &LazyTensor, actions: &LazyTensor, rewards: &LazyTensor| {
        let next_q = tch::no_grad(|| next_obs.apply(&target).max_dim(1, false).0);
        assert!(!next_q.requires_grad(), "recorded under no_grad, as eagerly");
        let q = obs.apply(&online).gather(1, actions, false).squeeze_dim(1);
        (q - (rewards + 0.99f64 * next_q)).square().mean(Kind::Float)
    };
    // Eagerly, tch's own.
    let next_q = tch::no_grad(|| next_obs.apply(&target).max_dim(1, false).0);
    let q = obs.apply(&online).gather(1, &actions, false).squeeze_dim(1);
    let expected = (q - (&rewards + 0.99f64 * next_q)).square().mean(Kind::Float);
    expected.backward();
    let grads: Vec<Tensor> = online_vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    for micro in [12usize, 5] {
        online_vs.trainable_variables().iter_mut().for_each(|v| v.zero_grad());
        let (o, n, a, r) = lazy((&obs, &next_obs, &actions, &rewards), 0);
        let value = loss_of(&o, &n, &a, &r).backward_with(&Options::new().micro_batch(micro)).unwrap();
        same(&format!("the loss, micro-batch {micro}"), &[value], &[expected.double_value(&[])], 1e-5);
        for (v, g) in online_vs.trainable_variables().iter().zip(&grads) {
            let diff = (v.grad() - g).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "micro-batch {micro}: the online network's gradient differs by {diff}");
        }
        for v in target_vs.trainable_variables() {
            assert!(!v.grad().defined(), "micro-batch {micro}: the target network got a gradient");
        }
    }
}

/// `max_dim` and `min_dim`, recorded as a `topk` of one: the values, the positions and the
/// gradient (to the chosen position) of tch's, whole and in micro-batches.
#[test]
fn max_dim_and_min_dim_are_tchs() {
    let mut x = Tensor::randn([10, 7], FLOAT_CPU).set_requires_grad(true);
    for keepdim in [false, true] {
        let ((max, argmax), (min, argmin)) = (x.max_dim(1, keepdim), x.min_dim(1, keepdim));
        let expected = max.sum(Kind::Float) * 2.0 - min.sum(Kind::Float);
        x.zero_grad();
        expected.backward();
        let grad = x.grad().copy();
        let lx = lazy(&x, 0);
        let ((lmax, largmax), (lmin, largmin)) = (lx.max_dim(1, keepdim), lx.min_dim(1, keepdim));
        assert!(largmax.to_tensor().unwrap().equal(&argmax) && largmin.to_tensor().unwrap().equal(&argmin));
        assert_eq!(lmax.size(), max.size());
        let loss = lmax.sum(Kind::Float) * 2.0 - lmin.sum(Kind::Float);
        x.zero_grad();
        let value = loss.backward_with(&Options::new().micro_batch(3)).unwrap();
        same("max_dim and min_dim", &[value], &[expected.double_value(&[])], 1e-6);
        assert!(x.grad().allclose(&grad, 1e-6, 1e-6, false), "keepdim {keepdim}: the gradient");
    }
}

// --- transfer-learning ------------------------------------------------------------------------

/// tch-rs's `transfer-learning`: a ResNet-18 without its last layer (weights as loaded; here
/// shared by both runs), the images' features computed once under `no_grad` (lazily, in
/// micro-batches: the one pass through the network), then a linear head trained on them with
/// `backward_step`, the test set's accuracy read each epoch.
fn transfer_learning(net: &vision::ResNet, head: &nn::VarStore, data: &[Tensor; 4], lazily: bool) -> Vec<f64> {
    let [train_images, train_labels, test_images, test_labels] = data;
    let features = |images: &Tensor| {
        if lazily {
            let planned = tch::no_grad(|| lazy(images, 0).apply_t(net, false));
            planned.to_tensor_with(&Options::new().micro_batch(7)).unwrap()
        } else {
            tch::no_grad(|| images.apply_t(net, false))
        }
    };
    let (train_images, test_images) = (features(train_images), features(test_images));
    assert!(!train_images.requires_grad(), "computed under no_grad");
    let mut vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root(), 512, 5, Default::default());
    vs.copy(head).unwrap();
    let mut sgd = nn::Sgd::default().build(&vs, 1e-1).unwrap();
    let mut out = vec![];
    for _epoch in 1..5 {
        let loss = if lazily {
            let (x, y) = lazy((&train_images, train_labels), 0);
            let loss = x.apply(&linear).cross_entropy_for_logits(&y);
            sgd.f_backward_step_with(&loss, &Options::new().micro_batch(6)).unwrap()
        } else {
            let loss = train_images.apply(&linear).cross_entropy_for_logits(train_labels);
            sgd.backward_step(&loss);
            loss.double_value(&[])
        };
        let test_accuracy = test_images.apply(&linear).accuracy_for_logits(test_labels);
        out.extend([loss, f64::try_from(test_accuracy).unwrap()]);
    }
    out.extend(weights(&vs));
    out
}

#[test]
fn tchs_transfer_learning_ports_with_features_computed_in_micro_batches() {
    let net_vs = nn::VarStore::new(Device::Cpu);
    let net = vision::resnet18_no_final_layer(&net_vs.root());
    let head = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(head.root(), 512, 5, Default::default());
    let data = [
        Tensor::randn([20, 3, 32, 32], FLOAT_CPU),
        Tensor::randint(5, [20], tch::kind::INT64_CPU),
        Tensor::randn([9, 3, 32, 32], FLOAT_CPU),
        Tensor::randint(5, [9], tch::kind::INT64_CPU),
    ];
    let features = tch::no_grad(|| data[0].apply_t(&net, false));
    assert_eq!(features.size(), [20, 512], "the network ends at its pooled features, as tch's");
    let eager = transfer_learning(&net, &head, &data, false);
    same("transfer-learning", &transfer_learning(&net, &head, &data, true), &eager, 1e-4);
}

// --- custom-optimizer ---------------------------------------------------------------------------

/// tch-rs's `custom-optimizer`: a sparse Adam of its own, which reads the store's variables
/// (`variables_`), each `.grad()`, and steps under `no_grad`; the gradients come from a lazy
/// loss's `backward()` over the whole batch.
struct SparseAdam {
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    vars: std::sync::Arc<std::sync::Mutex<tch::nn::Variables>>,
    moments: Vec<(Tensor, Tensor)>,
    t: i32,
}

impl SparseAdam {
    fn new(vs: &nn::VarStore, lr: f64) -> SparseAdam {
        let vars = vs.variables_.clone();
        let moments = vars
            .lock()
            .unwrap()
            .trainable_variables
            .iter()
            .map(|x| (x.tensor.zeros_like(), x.tensor.zeros_like()))
            .collect();
        SparseAdam { lr, betas: (0.9, 0.999), eps: 1e-8, vars, moments, t: 0 }
    }

    fn zero_grad(&mut self) {
        for var in &mut self.vars.lock().unwrap().trainable_variables {
            var.tensor.zero_grad();
        }
    }

    fn step(&mut self) {
        tch::no_grad(|| {
            self.t += 1;
            let (b1, b2) = self.betas;
            let (c1, c2) = (1.0 - b1.powi(self.t), 1.0 - b2.powi(self.t));
            let mut vars = self.vars.lock().unwrap();
            for (var, (m, v)) in vars.trainable_variables.iter_mut().zip(&mut self.moments) {
                let grad = var.tensor.grad();
                *m *= b1;
                *m += (1.0 - b1) * &grad;
                *v *= b2;
                let scaled = grad * (1.0 - b2).sqrt();
                let _ = v.addcmul_(&scaled, &scaled);
                let part1 = &*m * (-self.lr / c1);
                let part2 = (&*v / c2).sqrt() + self.eps;
                let _ = var.tensor.addcdiv_(&part1, &part2);
            }
        })
    }
}

fn custom_optimizer(start: &nn::VarStore, images: &Tensor, labels: &Tensor, lazily: bool) -> Vec<f64> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layer1", 784, 32, Default::default()))
        .add_fn(|xs| xs.relu())
        .add(nn::linear(vs.root(), 32, 10, Default::default()));
    vs.copy(start).unwrap();
    let mut opt = SparseAdam::new(&vs, 5e-3);
    let mut out = vec![];
    for _epoch in 1..5 {
        opt.zero_grad();
        let loss = if lazily {
            let (x, y) = lazy((images, labels), 0);
            x.apply(&net).cross_entropy_for_logits(&y).backward().unwrap()
        } else {
            let loss = net.forward(images).cross_entropy_for_logits(labels);
            loss.backward();
            loss.double_value(&[])
        };
        opt.step();
        let accuracy = net.forward(images).accuracy_for_logits(labels);
        out.extend([loss, f64::try_from(&accuracy).unwrap()]);
    }
    out.extend(weights(&vs));
    out
}

#[test]
fn tchs_custom_optimizer_steps_on_a_lazy_losss_gradients() {
    let start = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(start.root() / "layer1", 784, 32, Default::default());
    let _ = nn::linear(start.root(), 32, 10, Default::default());
    let images = Tensor::rand([50, 784], FLOAT_CPU);
    let labels = Tensor::randint(10, [50], tch::kind::INT64_CPU);
    let eager = custom_optimizer(&start, &images, &labels, false);
    same("custom-optimizer", &custom_optimizer(&start, &images, &labels, true), &eager, 1e-5);
}
