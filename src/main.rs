fn main() {
    eprintln!("vantage: not yet implemented");
    std::process::exit(1);
}
