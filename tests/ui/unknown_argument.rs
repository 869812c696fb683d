#[toma::batch(initial_batchsize = 8, retries = 3)]
fn f(batchsize: usize) -> usize {
    batchsize
}

fn main() {}
