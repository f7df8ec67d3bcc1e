fn main() {
    println!("mbtunnel {}", env!("CARGO_PKG_VERSION"));
}
