//! The README's example compiles (as `examples/readme.rs`), runs, and is still what the README
//! shows.

mod readme {
    include!("../examples/readme.rs");

    #[test]
    fn readme_example_runs() {
        main().expect("the README example runs");
    }
}

#[test]
fn readme_shows_the_example_verbatim() {
    let readme = include_str!("../../README.md");
    let example = include_str!("../examples/readme.rs");
    let block = format!("```rust\n{example}```");
    assert!(readme.contains(&block), "README.md must contain benches/examples/readme.rs verbatim in a ```rust block");
}
