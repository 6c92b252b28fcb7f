//! `ferrolog`: the command line (being written).

fn main() {}
