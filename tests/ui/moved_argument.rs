// The body runs once per attempt, so it cannot consume an argument it does not own again.
#[toma::batch(initial_batchsize = 8)]
fn consume(batchsize: usize, names: Vec<String>) -> usize {
    let owned: Vec<String> = names;
    owned.len() + batchsize
}

fn main() {
    let _ = consume(vec![]);
}
