//! fsdp's examples as `cargo test --workspace` builds them, beside the test binaries: shared
//! by the test crates of the workspace (by `#[path]`).

use std::path::{Path, PathBuf};

/// Example `name`'s executable in this test binary's profile folder; an error when it is
/// missing or older than its `source`.
pub fn built_example(name: &str, source: &Path) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let built = profile_dir.join("examples").join(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    assert!(
        modified(&built) >= modified(source),
        "{} is missing or older than {}: run `cargo test --workspace`, or `cargo build --profile test -p fsdp --examples` first",
        built.display(),
        source.display()
    );
    built
}
