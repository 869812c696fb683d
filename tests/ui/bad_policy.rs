#[toma::batch(initial_batchsize = 8, policy = factor(1.5))]
fn a(batchsize: usize) -> usize {
    batchsize
}

#[toma::batch(initial_batchsize = 8, policy = factor)]
fn b(batchsize: usize) -> usize {
    batchsize
}

fn main() {}
