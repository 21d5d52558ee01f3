//! Drain and latency benchmark: being written (see docs/performance.md once it lands).

fn main() {
    println!("drain bench: not written yet");
}
