#[toma::range(initial_step = 8)]
fn total(start: usize, end: usize) -> usize {
    end - start
}

fn main() {}
