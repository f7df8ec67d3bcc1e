//! Log output in batches, written by a thread of its own.
//!
//! `tracing`'s formatter writes each event with one `write` on the thread that emitted it. At a
//! connection per request that is a system call per access line on a proxy worker (with `info`
//! logging, the line and the write were ~12 % of a connection's proxy CPU), and a log consumer
//! that stops reading (a full stderr pipe) stalls the data plane. Here an event only appends its
//! line to a shared buffer; a flusher thread writes what gathered at most [`BATCH_WINDOW`] after
//! the first line of a batch, in one `write` per batch. When the output does not keep up, the
//! buffer holds at most [`MAX_BUFFERED`] bytes: later lines are dropped (never a partial line),
//! counted, and reported in the output once it moves again. [`LogGuard`] flushes what is left
//! when `run` returns, and the panic hook flushes before the panic message is printed.
#![forbid(unsafe_code)]

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How long the flusher lets lines gather after the first one of a batch.
pub const BATCH_WINDOW: Duration = Duration::from_millis(50);
/// Buffered bytes that wake the flusher before the window ends.
const EAGER_FLUSH: usize = 64 * 1024;
/// Most bytes held while the output is blocked; lines beyond are dropped and counted.
pub const MAX_BUFFERED: usize = 4 * 1024 * 1024;

struct Pending {
    buf: Vec<u8>,
    /// Lines dropped since the last one buffered; reported where they were lost.
    dropped: u64,
    closed: bool,
}

struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
    /// The output; held while a batch is written, so batches leave in the order they formed.
    out: Mutex<Box<dyn Write + Send>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave a half-written line behind (lines are
    // appended whole): keep logging.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Appends one formatted event (the formatter writes each event with a single call).
    fn append(&self, line: &[u8]) {
        let mut p = lock(&self.pending);
        if p.buf.len() + line.len() > MAX_BUFFERED {
            p.dropped += 1;
            return;
        }
        let was_empty = p.buf.is_empty();
        report_drops(&mut p);
        p.buf.extend_from_slice(line);
        if p.closed {
            // No flusher any more (the guard is gone): write through.
            drop(p);
            self.flush_now();
            return;
        }
        let eager = p.buf.len() >= EAGER_FLUSH && p.buf.len() - line.len() < EAGER_FLUSH;
        drop(p);
        if was_empty || eager {
            self.wake.notify_one();
        }
    }

    /// Writes everything buffered now, on the calling thread.
    fn flush_now(&self) {
        let mut out = lock(&self.out);
        let batch = {
            let mut p = lock(&self.pending);
            report_drops(&mut p);
            std::mem::take(&mut p.buf)
        };
        // Write errors (a closed stderr) are ignored, as the formatter ignores them.
        if !batch.is_empty() {
            let _ = out.write_all(&batch);
            let _ = out.flush();
        }
    }

    fn flusher(self: Arc<Self>) {
        loop {
            let mut p = lock(&self.pending);
            while p.buf.is_empty() && !p.closed {
                p = self.wake.wait(p).unwrap_or_else(|e| e.into_inner());
            }
            if p.closed {
                return;
            }
            // Let the batch gather, unless it is already large.
            if p.buf.len() < EAGER_FLUSH {
                p = self
                    .wake
                    .wait_timeout_while(p, BATCH_WINDOW, |p| p.buf.len() < EAGER_FLUSH && !p.closed)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            drop(p);
            self.flush_now();
        }
    }
}

/// Puts the count of lines dropped since the last buffered one into the buffer, where they
/// would have been.
fn report_drops(p: &mut Pending) {
    if p.dropped > 0 {
        let n = std::mem::take(&mut p.dropped);
        let _ = writeln!(p.buf, "mbtunnel: {n} log lines dropped: the log output did not keep up");
    }
}

/// The writer handed to `tracing_subscriber::fmt::layer().with_writer(..)`.
#[derive(Clone)]
pub struct BatchWriter {
    shared: Arc<Shared>,
}

/// Flushes and stops the flusher thread when dropped; lines logged after that are written
/// through.
pub struct LogGuard {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BatchWriter {
    /// A writer to `out`, its flusher thread (named `mbt-log`), and the guard that flushes the
    /// rest at the end. Fails only when the thread cannot be started.
    pub fn new(out: Box<dyn Write + Send>) -> std::io::Result<(BatchWriter, LogGuard)> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending { buf: Vec::new(), dropped: 0, closed: false }),
            wake: Condvar::new(),
            out: Mutex::new(out),
        });
        let s = shared.clone();
        let thread =
            std::thread::Builder::new().name("mbt-log".into()).spawn(move || s.flusher())?;
        Ok((BatchWriter { shared: shared.clone() }, LogGuard { shared, thread: Some(thread) }))
    }

    /// Writes what is buffered now (used by the panic hook).
    pub fn flush_now(&self) {
        self.shared.flush_now();
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        lock(&self.shared.pending).closed = true;
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.shared.flush_now();
    }
}

/// One event's line on its way into the buffer.
pub struct LineWriter<'a> {
    shared: &'a Shared,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.shared.append(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for BatchWriter {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> LineWriter<'a> {
        LineWriter { shared: &self.shared }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// An output whose bytes the test can read.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Sink {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    fn emit(w: &BatchWriter, line: &str) {
        use tracing_subscriber::fmt::MakeWriter;
        w.make_writer().write_all(line.as_bytes()).unwrap();
    }

    #[test]
    fn lines_from_many_threads_arrive_whole_and_in_each_threads_order() {
        let sink = Sink::default();
        let (w, guard) = BatchWriter::new(Box::new(sink.clone())).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        emit(&w, &format!("thread {t} line {i} {}\n", "x".repeat(i % 97)));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(guard);
        let text = sink.text();
        let mut next = [0usize; 4];
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let (t, i): (usize, usize) = (f[1].parse().unwrap(), f[3].parse().unwrap());
            assert_eq!(i, next[t], "thread {t}'s lines out of order or lost");
            assert_eq!(f[4].len(), i % 97, "line {line:?} cut or mixed with another");
            next[t] += 1;
        }
        assert_eq!(next, [2000; 4]);
    }

    #[test]
    fn a_line_reaches_the_output_without_an_explicit_flush() {
        let sink = Sink::default();
        let (w, _guard) = BatchWriter::new(Box::new(sink.clone())).unwrap();
        emit(&w, "first\n");
        // Liveness, not timing: the flusher must write it eventually (here: within 10 s).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while sink.text() != "first\n" {
            assert!(std::time::Instant::now() < deadline, "the flusher never wrote the line");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn lines_after_the_guard_is_gone_are_written_through() {
        let sink = Sink::default();
        let (w, guard) = BatchWriter::new(Box::new(sink.clone())).unwrap();
        emit(&w, "one\n");
        drop(guard);
        assert_eq!(sink.text(), "one\n");
        emit(&w, "two\n");
        assert_eq!(sink.text(), "one\ntwo\n");
    }

    /// An output that blocks until the test lets it go.
    struct Blocked {
        gate: mpsc::Receiver<()>,
        sink: Sink,
    }

    impl Write for Blocked {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.gate.recv();
            self.sink.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_blocked_output_never_blocks_the_emitter_and_drops_are_reported() {
        let sink = Sink::default();
        let (open, gate) = mpsc::channel();
        let (w, guard) = BatchWriter::new(Box::new(Blocked { gate, sink: sink.clone() })).unwrap();
        // The first batch is taken by the flusher, which then blocks in the write.
        emit(&w, "before\n");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !lock(&w.shared.pending).buf.is_empty() {
            assert!(std::time::Instant::now() < deadline, "the flusher never took the batch");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Far more than the buffer holds: every call returns, the excess is counted.
        let line = format!("{}\n", "y".repeat(1023));
        let n = 2 * MAX_BUFFERED / line.len();
        for _ in 0..n {
            emit(&w, &line);
        }
        let kept = MAX_BUFFERED / line.len();
        assert_eq!(lock(&w.shared.pending).dropped as usize, n - kept);
        // Let the output move: everything kept arrives, then the report of what was dropped,
        // then what came after.
        std::thread::spawn(move || while open.send(()).is_ok() {});
        while !lock(&w.shared.pending).buf.is_empty() {
            assert!(std::time::Instant::now() < deadline + Duration::from_secs(20), "stuck");
            std::thread::sleep(Duration::from_millis(1));
        }
        emit(&w, "after\n");
        drop(guard);
        let text = sink.text();
        assert!(text.starts_with("before\n"));
        assert_eq!(text.matches(&line).count(), kept);
        let report =
            format!("mbtunnel: {} log lines dropped: the log output did not keep up\n", n - kept);
        assert!(text.ends_with(&format!("{line}{report}after\n")), "drop report misplaced");
    }
}
