//! A fault-injecting TCP proxy for tests (a small stand-in for toxiproxy).
//!
//! `Proxy::start(target)` listens on 127.0.0.1 (any free port) and forwards
//! each accepted connection to `target`. `set_mode` changes its behaviour at
//! run time, for open and new connections alike (see [`Mode`]).
//!
//! The proxy runs on its own OS thread with its own tokio runtime, so it keeps
//! serving while the test's runtime is blocked in std code. Dropping the proxy
//! stops it: the thread is joined and every socket is closed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Forward both ways.
    Pass,
    /// Reset (RST) every open connection now, and new ones right after accept.
    Reset,
    /// Keep connections open but forward nothing; bytes read are discarded.
    /// A connection that lost bytes this way stays dead after the mode
    /// changes (its stream is corrupt); new connections work again.
    Blackhole,
    /// Forward, holding each chunk this long (one at a time, per connection;
    /// a switch to Reset takes effect once the chunk in hand is sent).
    Delay(Duration),
    /// Forward the request, pass at most this many bytes of the server's
    /// response (per connection), then close the connection.
    CutResponse(usize),
    /// Forward, but cut the connection of each HTTP request whose request
    /// line holds every one of `line` (e.g. a PUT of a Delta log entry),
    /// until `limit` requests were cut since the mode was set (see
    /// [`Proxy::cuts`]); `at` says how.
    CutRequests {
        line: &'static [&'static str],
        at: Cut,
        limit: usize,
    },
}

/// How [`Mode::CutRequests`] cuts a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Reset before any byte of it reaches the server.
    Before,
    /// The server gets it whole; the connection is reset as the answer
    /// arrives, before the client sees any of it.
    Answer,
    /// The server gets it whole; the connection is closed (FIN, not RST)
    /// in place of the answer.
    AnswerClosed,
}

pub(crate) struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    connections: Arc<AtomicUsize>,
    cuts: Arc<AtomicUsize>,
    requests: Requests,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The HTTP request lines clients sent, in order (see [`Proxy::requests`]).
type Requests = Arc<Mutex<Vec<String>>>;

impl Proxy {
    /// Starts a proxy to `target` in `Mode::Pass`.
    pub(crate) fn start(target: SocketAddr) -> Proxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, mode_rx) = watch::channel(Mode::Pass);
        let connections = Arc::new(AtomicUsize::new(0));
        let (stop, stop_rx) = oneshot::channel();
        let cuts = Arc::new(AtomicUsize::new(0));
        let requests = Requests::default();
        let count = connections.clone();
        let cut = cuts.clone();
        let seen = requests.clone();
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{addr}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(accept_loop(
                    listener, target, mode_rx, count, cut, seen, stop_rx,
                ));
                // Dropping the runtime drops every connection task and its sockets.
            })
            .unwrap();
        Proxy {
            addr,
            mode,
            connections,
            cuts,
            requests,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Where clients connect.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`, for HTTP clients.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sets the mode; the count of [`Proxy::cuts`] starts again at 0.
    pub(crate) fn set_mode(&self, mode: Mode) {
        self.cuts.store(0, Ordering::SeqCst);
        self.mode.send_replace(mode);
    }

    /// Requests cut under [`Mode::CutRequests`] since the mode was set.
    pub(crate) fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }

    pub(crate) fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// The HTTP request lines (`HEAD /bucket/key HTTP/1.1`) clients sent
    /// so far, in every mode.
    pub(crate) fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    /// Connections accepted so far.
    pub(crate) fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(
    listener: std::net::TcpListener,
    target: SocketAddr,
    mode: watch::Receiver<Mode>,
    count: Arc<AtomicUsize>,
    cuts: Arc<AtomicUsize>,
    requests: Requests,
    mut stop: oneshot::Receiver<()>,
) {
    let listener = TcpListener::from_std(listener).unwrap();
    loop {
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(client, target, mode.clone(), cuts.clone(), requests.clone()));
            }
        }
    }
}

/// Closes a connection with RST (SO_LINGER 0) rather than FIN.
fn reset(rd: OwnedReadHalf, wr: OwnedWriteHalf) {
    if let Ok(stream) = rd.reunite(wr) {
        let _ = stream.set_zero_linger();
    }
}

/// Whether `data` holds an HTTP request line that has every one of `parts`.
fn request_line_with(data: &[u8], parts: &[&str]) -> bool {
    request_lines(data).any(|line| parts.iter().all(|p| line.contains(p)))
}

/// The HTTP request lines in `data`.
fn request_lines(data: &[u8]) -> impl Iterator<Item = String> + '_ {
    data.split(|&b| b == b'\n')
        .map(|line| String::from_utf8_lossy(line).trim_end().to_string())
        .filter(|line| line.contains(" HTTP/1."))
}

/// Counts one more cut if fewer than `limit` were made.
fn take_cut(cuts: &AtomicUsize, limit: usize) -> bool {
    cuts.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
        (n < limit).then_some(n + 1)
    })
    .is_ok()
}

async fn serve(
    client: TcpStream,
    target: SocketAddr,
    mut mode: watch::Receiver<Mode>,
    cuts: Arc<AtomicUsize>,
    requests: Requests,
) {
    if *mode.borrow_and_update() == Mode::Reset {
        let _ = client.set_zero_linger();
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        let _ = client.set_zero_linger();
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (mut c_rd, mut c_wr) = client.into_split();
    let (mut s_rd, mut s_wr) = server.into_split();
    let (mut c_buf, mut s_buf) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let (mut c_open, mut s_open) = (true, true); // still reading from that side
    let mut dead = false; // lost bytes to Blackhole: forwards nothing ever again
    let mut cut = 0; // response bytes passed under CutResponse
    let mut cut_answer = None; // a request cut under CutRequests, sent on
    while c_open || s_open {
        let (up, read) = tokio::select! {
            r = c_rd.read(&mut c_buf), if c_open => (true, r),
            r = s_rd.read(&mut s_buf), if s_open => (false, r),
            changed = mode.changed() => {
                if changed.is_err() || *mode.borrow_and_update() == Mode::Reset {
                    reset(c_rd, c_wr);
                    reset(s_rd, s_wr);
                    return;
                }
                continue;
            }
        };
        let Ok(n) = read else { break }; // a reset on either side ends both
        let current = *mode.borrow();
        let (data, out) = if up {
            (&c_buf[..n], &mut s_wr)
        } else {
            (&s_buf[..n], &mut c_wr)
        };
        if n == 0 {
            // EOF: pass the half-close on, unless the link is down.
            *(if up { &mut c_open } else { &mut s_open }) = false;
            if !dead && current != Mode::Blackhole {
                let _ = out.shutdown().await;
            }
            continue;
        }
        if up {
            requests.lock().unwrap().extend(request_lines(data));
        }
        let data = match current {
            Mode::Reset => {
                reset(c_rd, c_wr);
                reset(s_rd, s_wr);
                return;
            }
            Mode::Blackhole => {
                dead = true;
                continue;
            }
            _ if dead => continue,
            _ if !up && cut_answer == Some(Cut::AnswerClosed) => {
                let _ = c_wr.shutdown().await;
                return;
            }
            _ if !up && cut_answer.is_some() => {
                reset(c_rd, c_wr);
                reset(s_rd, s_wr);
                return;
            }
            Mode::Pass => data,
            Mode::Delay(d) => {
                tokio::time::sleep(d).await;
                data
            }
            Mode::CutRequests { line, at, limit }
                if up && request_line_with(data, line) && take_cut(&cuts, limit) =>
            {
                if at == Cut::Before {
                    reset(c_rd, c_wr);
                    reset(s_rd, s_wr);
                    return;
                }
                cut_answer = Some(at);
                data
            }
            Mode::CutRequests { .. } => data,
            Mode::CutResponse(_) if up => data,
            Mode::CutResponse(limit) => {
                let take = n.min(limit.saturating_sub(cut));
                cut += take;
                if out.write_all(&data[..take]).await.is_err() || cut >= limit {
                    let _ = out.shutdown().await;
                    return;
                }
                continue;
            }
        };
        if out.write_all(data).await.is_err() {
            break;
        }
    }
}
