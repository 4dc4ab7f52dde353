//! # tessera-files: how Tessera reads and writes files
//!
//! One piece of code for every file Tessera writes (`tessera convert` and `tessera synth` GGUFs,
//! `tessera run --dump-logits`, the CUDA kernel cache) and for the files it is given to read.
//!
//! - **Atomic outputs.** An [`AtomicFile`] writes to a temporary file in the target's directory
//!   (`.NAME.tessera-PID-N.tmp`, created exclusively, with the old target's permissions); on
//!   [`AtomicFile::commit`] it is flushed, fsynced and renamed over the target, and the directory
//!   is fsynced. Dropped without a commit (an error, a panic that unwinds), it removes the
//!   temporary: the old target, if any, is untouched. A target that is a symbolic link is written
//!   through (the file it points to is replaced, the link stays).
//! - **Cleanup at exit.** Every temporary not yet committed or dropped is in a process-wide
//!   registry: [`exit_removing_temporaries`] removes them and exits (for exits that skip
//!   destructors), and [`exit_on_signals`] (feature `signals`) does it on SIGINT / SIGTERM, with
//!   status 130 / 143.
//! - **Outputs checked before work.** [`check_output`] refuses an output that is a directory or
//!   another non-regular file, or that is (or resolves to, through links) the same file as an
//!   input, and checks that its directory exists and is writable by creating and removing a
//!   temporary there: a command can fail in milliseconds instead of after its work.
//! - **Inputs that are regular files.** [`open_input`] refuses a directory, FIFO, socket or device
//!   with a message that says so, and never blocks: the file type is checked before opening, and
//!   the open itself is non-blocking.
//!
//! Errors are [`io::Error`]s whose message says what was wrong without repeating the path the
//! caller passed (callers print `{path}: {error}`); other paths (the directory, the input) are
//! named in the message.
//!
//! This crate is for Unix (dev/inode identity, `O_NONBLOCK`, permission bits), like the rest of
//! Tessera.

use std::ffi::OsStr;
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, BufWriter, ErrorKind, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The buffer of an [`AtomicFile`]: large writes (GGUF tensors) pass through, small ones
/// (headers, rows) are batched.
const BUFFER_BYTES: usize = 1 << 20;

/// The longest part of the target's name kept in a temporary's name, so that the temporary's name
/// stays under the usual 255-byte limit.
const NAME_BYTES_KEPT: usize = 160;

/// Temporaries created and not yet committed or removed: (id, path).
static TEMPORARIES: Mutex<Vec<(u64, PathBuf)>> = Mutex::new(Vec::new());

/// Makes temporary names unique within the process (the pid makes them unique between processes).
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// The registry, also when a thread panicked while holding it (its list is still right: every
/// change is one push or one removal).
fn temporaries() -> MutexGuard<'static, Vec<(u64, PathBuf)>> {
    TEMPORARIES.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An error of kind `kind` with `message`.
fn error(kind: ErrorKind, message: String) -> io::Error {
    io::Error::new(kind, message)
}

/// `e` with `what` in front of its message, keeping its kind.
fn context(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// What kind of file `m` describes, for messages: `a directory`, `a FIFO (named pipe)`, ...
fn kind_of(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a special file"
    }
}

/// `Ok` when `m` is a regular file; else `is a directory` / `is not a regular file (it is a FIFO
/// (named pipe))`.
fn require_regular(m: &Metadata) -> io::Result<()> {
    if m.is_file() {
        Ok(())
    } else if m.is_dir() {
        Err(error(ErrorKind::IsADirectory, "is a directory, not a file".into()))
    } else {
        Err(error(ErrorKind::InvalidInput, format!("is not a regular file (it is {})", kind_of(m))))
    }
}

/// The file an output at `path` replaces: `path` itself, or what it points to when it is a
/// symbolic link (a dangling link is replaced by the file). Refuses an existing directory or other
/// non-regular file: renaming over a device or FIFO would replace it, not write to it.
fn resolve_target(path: &Path) -> io::Result<PathBuf> {
    if path.as_os_str().is_empty() {
        return Err(error(ErrorKind::InvalidInput, "an empty path is not a file name".into()));
    }
    let target = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
        Ok(_) => path.to_path_buf(),
        // Absent, or under a path that is not a directory: `require_dir` says which.
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            return Ok(path.to_path_buf());
        }
        Err(e) => return Err(e),
    };
    match fs::metadata(&target) {
        Ok(m) => require_regular(&m)?,
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(target)
}

/// The directory `target` is in (`.` for a bare file name).
fn dir_of(target: &Path) -> &Path {
    match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// `Ok` when `dir` exists and is a directory.
fn require_dir(dir: &Path) -> io::Result<()> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(error(
            ErrorKind::NotADirectory,
            format!("{} is not a directory (it is {})", dir.display(), kind_of(&m)),
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            Err(error(ErrorKind::NotFound, format!("directory {} does not exist", dir.display())))
        }
        Err(e) => Err(context(e, format_args!("directory {}", dir.display()))),
    }
}

/// Creates a new, empty temporary file for `target` in `dir` and registers it. Holding the
/// registry while creating means a signal's cleanup either sees the file or runs before it exists.
fn create_temporary(dir: &Path, target: &Path) -> io::Result<(File, PathBuf, u64)> {
    let name = target.file_name().ok_or_else(|| error(ErrorKind::InvalidInput, "has no file name".into()))?;
    let kept = &name.as_bytes()[..name.len().min(NAME_BYTES_KEPT)];
    let mut registry = temporaries();
    loop {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut temp_name = b".".to_vec();
        temp_name.extend_from_slice(kept);
        temp_name.extend_from_slice(format!(".tessera-{}-{id}.tmp", std::process::id()).as_bytes());
        let temp = dir.join(OsStr::from_bytes(&temp_name));
        match OpenOptions::new().write(true).create_new(true).open(&temp) {
            Ok(file) => {
                registry.push((id, temp.clone()));
                return Ok((file, temp, id));
            }
            // Left by a process with the same pid that was killed: take the next name.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(context(e, format_args!("cannot create a file in directory {}", dir.display()))),
        }
    }
}

/// Removes the temporary `id` at `path` and forgets it.
fn remove_temporary(id: u64, path: &Path) {
    let mut registry = temporaries();
    let _ = fs::remove_file(path);
    registry.retain(|(i, _)| *i != id);
}

/// A file written in full or not at all; see the crate doc.
///
/// ```
/// use std::io::Write;
/// use tessera_files::AtomicFile;
///
/// let dir = std::env::temp_dir().join(format!("tessera_files_doc_{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("out.txt");
/// std::fs::write(&path, "old")?;
///
/// let mut f = AtomicFile::create(&path)?;
/// f.write_all(b"half")?;
/// drop(f); // an error before the commit: the old file stays, the temporary is gone
/// assert_eq!(std::fs::read_to_string(&path)?, "old");
///
/// let mut f = AtomicFile::create(&path)?;
/// f.write_all(b"new")?;
/// f.commit()?;
/// assert_eq!(std::fs::read_to_string(&path)?, "new");
/// assert_eq!(std::fs::read_dir(&dir)?.count(), 1);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct AtomicFile {
    /// `None` once [`AtomicFile::commit`] has taken it.
    out: Option<BufWriter<File>>,
    temp: PathBuf,
    target: PathBuf,
    id: u64,
    /// Renamed over the target: nothing left to remove.
    committed: bool,
}

impl AtomicFile {
    /// Starts writing a file that will replace `path` on [`AtomicFile::commit`]. Fails at once
    /// when `path` is a directory or another non-regular file, when its directory does not exist
    /// or is not a directory, or when a file cannot be created there.
    pub fn create(path: impl AsRef<Path>) -> io::Result<AtomicFile> {
        let target = resolve_target(path.as_ref())?;
        let dir = dir_of(&target);
        require_dir(dir)?;
        let (file, temp, id) = create_temporary(dir, &target)?;
        let mut this = AtomicFile { out: None, temp, target, id, committed: false };
        // The replacement keeps the old file's permissions (else a new file's: 0666 less umask).
        if let Ok(old) = fs::metadata(&this.target) {
            file.set_permissions(old.permissions())
                .map_err(|e| context(e, format_args!("setting the permissions of {}", this.temp.display())))?;
        }
        this.out = Some(BufWriter::with_capacity(BUFFER_BYTES, file));
        Ok(this)
    }

    /// The file that [`AtomicFile::commit`] replaces (the link's target when the path given was a
    /// symbolic link).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The temporary file being written.
    pub fn temporary(&self) -> &Path {
        &self.temp
    }

    /// Flushes and fsyncs the temporary, renames it over the target, and fsyncs the directory.
    /// On an error before the rename the temporary is removed and the target is untouched.
    pub fn commit(mut self) -> io::Result<()> {
        let out = self.out.take().ok_or_else(|| error(ErrorKind::Other, "already committed".into()))?;
        let temp = self.temp.display().to_string();
        let file = out.into_inner().map_err(|e| context(e.into_error(), format_args!("writing {temp}")))?;
        file.sync_all().map_err(|e| context(e, format_args!("syncing {temp}")))?;
        drop(file);
        {
            // Under the registry's lock: a signal's cleanup runs wholly before or wholly after.
            let mut registry = temporaries();
            fs::rename(&self.temp, &self.target).map_err(|e| context(e, format_args!("renaming {temp}")))?;
            registry.retain(|(i, _)| *i != self.id);
            self.committed = true;
        }
        sync_dir(dir_of(&self.target))
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.out {
            Some(out) => out.write(buf),
            None => Err(error(ErrorKind::Other, "already committed".into())),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match &mut self.out {
            Some(out) => out.write_all(buf),
            None => Err(error(ErrorKind::Other, "already committed".into())),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.as_mut().map_or(Ok(()), BufWriter::flush)
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            // Discard the buffer rather than flush it into a file about to be removed.
            if let Some(out) = self.out.take() {
                drop(out.into_parts());
            }
            remove_temporary(self.id, &self.temp);
        }
    }
}

/// Makes a rename in `dir` durable. Filesystems that cannot sync a directory (`EINVAL`) are
/// accepted: there the rename is as durable as they make it.
fn sync_dir(dir: &Path) -> io::Result<()> {
    let synced = File::open(dir).and_then(|d| d.sync_all());
    match synced {
        Err(e) if e.kind() != ErrorKind::InvalidInput && e.kind() != ErrorKind::Unsupported => {
            Err(context(e, format_args!("syncing directory {}", dir.display())))
        }
        _ => Ok(()),
    }
}

/// Writes `bytes` to `path` through an [`AtomicFile`].
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> io::Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit()
}

/// Checks, before any work, that an output can be written at `path`: it is not a directory or
/// other non-regular file, it is not the same file as any of `inputs` (compared by device and
/// inode, so links and other spellings of the path count), and its directory exists and takes a
/// new file (one is created and removed). Inputs that do not exist are skipped.
pub fn check_output(path: impl AsRef<Path>, inputs: &[&Path]) -> io::Result<()> {
    let path = path.as_ref();
    let target = resolve_target(path)?;
    if let Ok(out) = fs::metadata(&target) {
        for input in inputs {
            if let Ok(m) = fs::metadata(input)
                && (m.dev(), m.ino()) == (out.dev(), out.ino())
            {
                return Err(error(
                    ErrorKind::InvalidInput,
                    format!("is the input file {}: refusing to overwrite an input", input.display()),
                ));
            }
        }
    }
    // The probe: a temporary created and removed where the output will be written.
    drop(AtomicFile::create(&target)?);
    Ok(())
}

/// Opens `path` for reading when it is a regular file. A directory is `is a directory`, a FIFO,
/// socket or device `is not a regular file (it is ...)`, checked before opening; the open is
/// non-blocking (a FIFO swapped in after the check cannot hang it) and the opened file is checked
/// again.
pub fn open_input(path: impl AsRef<Path>) -> io::Result<File> {
    let path = path.as_ref();
    require_regular(&fs::metadata(path)?)?;
    // O_NONBLOCK changes nothing for a regular file's reads or mmap.
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    require_regular(&file.metadata()?)?;
    Ok(file)
}

/// The whole of the regular file `path` ([`open_input`]).
pub fn read_input(path: impl AsRef<Path>) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    open_input(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The whole of the regular file `path` as UTF-8 ([`open_input`]).
pub fn read_input_to_string(path: impl AsRef<Path>) -> io::Result<String> {
    let mut text = String::new();
    open_input(path)?.read_to_string(&mut text)?;
    Ok(text)
}

/// Removes every temporary of an [`AtomicFile`] not yet committed or dropped, then exits with
/// `code`. For exits that skip destructors (a closed stdout, a signal). The registry stays locked
/// until the process is gone, so no new temporary appears meanwhile.
pub fn exit_removing_temporaries(code: i32) -> ! {
    let mut registry = temporaries();
    for (_, path) in registry.drain(..) {
        let _ = fs::remove_file(path);
    }
    std::process::exit(code)
}

/// On SIGINT or SIGTERM, removes the unfinished outputs ([`exit_removing_temporaries`]) and exits
/// with 128 + the signal number (130, 143), as a shell reports a process those signals ended.
/// Runs the cleanup on a thread of its own (signal-hook's iterator): in the signal handler itself
/// neither taking the registry's lock nor allocating is allowed.
#[cfg(feature = "signals")]
pub fn exit_on_signals() -> io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    std::thread::Builder::new().name("tessera-signals".into()).spawn(move || {
        if let Some(signal) = signals.forever().next() {
            let name = if signal == SIGINT { "SIGINT" } else { "SIGTERM" };
            let _ = writeln!(io::stderr(), "\ninterrupted by {name}: unfinished output files removed");
            exit_removing_temporaries(128 + signal);
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn commit_replaces_and_drop_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        write_atomic(&path, b"first").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"first");
        {
            let mut f = AtomicFile::create(&path).unwrap();
            f.write_all(&vec![7u8; 3 * BUFFER_BYTES]).unwrap();
            assert!(f.temporary().exists());
            assert_eq!(names(dir.path()).len(), 2);
        }
        assert_eq!(fs::read(&path).unwrap(), b"first", "an uncommitted write leaves the old file");
        assert_eq!(names(dir.path()), ["a.bin"], "and no temporary");
        write_atomic(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        assert_eq!(names(dir.path()), ["a.bin"]);
        assert!(temporaries().iter().all(|(_, p)| !p.starts_with(dir.path())));
    }

    #[test]
    fn permissions_are_kept_and_links_written_through() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.txt");
        fs::write(&real, "old").unwrap();
        fs::set_permissions(&real, fs::Permissions::from_mode(0o640)).unwrap();
        let link = dir.path().join("link.txt");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays");
        assert_eq!(fs::read(&real).unwrap(), b"new");
        assert_eq!(fs::metadata(&real).unwrap().permissions().mode() & 0o777, 0o640);
    }

    #[test]
    fn outputs_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.gguf");
        fs::write(&input, "model").unwrap();
        let e = check_output(&input, &[&input]).unwrap_err().to_string();
        assert!(e.contains("is the input file") && e.contains("in.gguf"), "{e}");
        // Another spelling of the same file, and a hard link.
        let e = check_output(dir.path().join(".").join("in.gguf"), &[&input]).unwrap_err();
        assert!(e.to_string().contains("is the input file"), "{e}");
        let hard = dir.path().join("hard.gguf");
        fs::hard_link(&input, &hard).unwrap();
        assert!(check_output(&hard, &[&input]).is_err());
        let soft = dir.path().join("soft.gguf");
        std::os::unix::fs::symlink(&input, &soft).unwrap();
        assert!(check_output(&soft, &[&input]).is_err());
        check_output(dir.path().join("out.gguf"), &[&input]).unwrap();
        check_output(&input, &[]).unwrap();

        let e = check_output(dir.path(), &[]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IsADirectory, "{e}");
        let missing = dir.path().join("missing/x.gguf");
        let e = check_output(&missing, &[]).unwrap_err().to_string();
        assert!(e.contains("does not exist") && e.contains("missing"), "{e}");
        let e = check_output(input.join("x.gguf"), &[]).unwrap_err().to_string();
        assert!(e.contains("is not a directory") && e.contains("a regular file"), "{e}");
        let e = check_output("/dev/null", &[]).unwrap_err().to_string();
        assert!(e.contains("character device"), "{e}");
        assert_eq!(names(dir.path()), ["hard.gguf", "in.gguf", "soft.gguf"], "the probes are removed");
        assert_eq!(fs::read(&input).unwrap(), b"model");
    }

    #[test]
    fn inputs_must_be_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let e = open_input(dir.path()).unwrap_err();
        assert_eq!(e.to_string(), "is a directory, not a file");
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let e = read_input(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file") && e.contains("FIFO"), "{e}");
        let e = open_input("/dev/null").unwrap_err().to_string();
        assert!(e.contains("character device"), "{e}");
        let file = dir.path().join("f.json");
        fs::write(&file, "{}").unwrap();
        assert_eq!(read_input_to_string(&file).unwrap(), "{}");
        assert_eq!(open_input(dir.path().join("nope")).unwrap_err().kind(), ErrorKind::NotFound);
    }

    #[test]
    fn temporaries_are_unique_and_registered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.cubin");
        let a = AtomicFile::create(&path).unwrap();
        let b = AtomicFile::create(&path).unwrap();
        assert_ne!(a.temporary(), b.temporary());
        let registered = |t: &Path| temporaries().iter().any(|(_, p)| p == t);
        assert!(registered(a.temporary()) && registered(b.temporary()));
        let (ta, tb) = (a.temporary().to_path_buf(), b.temporary().to_path_buf());
        a.commit().unwrap();
        drop(b);
        assert!(!registered(&ta) && !registered(&tb));
        assert_eq!(names(dir.path()), ["k.cubin"]);
    }
}
