//! `cargo run --release --example rsa_speed -- [seconds] [--json]`: the `speed` report without the CLI.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let secs = args.iter().find_map(|a| a.parse::<f64>().ok()).unwrap_or(2.0);
    let mut opts = mbtunnel::speed::SpeedOptions::with_seconds(secs);
    if let Ok(b) = std::env::var("SPEED_BITS") {
        opts.rsa_bits = b.split(',').filter_map(|x| x.parse().ok()).collect();
    }
    let report = mbtunnel::speed::run_speed(&opts);
    if args.iter().any(|a| a == "--json") {
        println!("{}", report.to_json());
    } else {
        print!("{report}");
    }
    eprint!("{}", mbtunnel::speed::doctor());
}
