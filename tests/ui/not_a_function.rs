#[toma::batch(initial_batchsize = 8)]
struct S;

#[toma::batch(initial_batchsize = 8)]
const fn f(batchsize: usize) -> usize {
    batchsize
}

fn main() {}
