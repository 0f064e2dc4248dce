//! The handshake that opens every connection: mutual challenge-response over the job
//! secret (HMAC-SHA256), naming the peer's identity.

use std::io::{self, Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::frame::{MAGIC, VERSION};
use super::{le_u16, le_u32};
use crate::error::{Error, Result};

/// Who is on the other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub job: String,
    pub task: u32,
    pub partition: u32,
    pub replica: u32,
}

/// Longest job id accepted in a handshake, in bytes of UTF-8.
pub const MAX_JOB_ID_LEN: usize = 256;
/// Bytes of each side's random nonce.
const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
const MAC_LEN: usize = 32;
/// Longest reject reason sent to a refused client.
const MAX_REASON_LEN: usize = 256;
/// Status byte the server sends after checking the client's proof.
const STATUS_ACCEPT: u8 = 0;
const STATUS_REJECT: u8 = 1;
/// Domain-separation labels so a client proof can never be replayed as a server proof.
const CLIENT_LABEL: &[u8] = b"tandem-handshake-client-v1";
const SERVER_LABEL: &[u8] = b"tandem-handshake-server-v1";

type HmacSha256 = Hmac<Sha256>;

/// The canonical bytes of an identity inside the MAC: job length (u16), job, task,
/// partition, replica (u32 each, little-endian).
fn identity_bytes(id: &Identity) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + id.job.len() + 12);
    out.extend_from_slice(&(id.job.len() as u16).to_le_bytes());
    out.extend_from_slice(id.job.as_bytes());
    out.extend_from_slice(&id.task.to_le_bytes());
    out.extend_from_slice(&id.partition.to_le_bytes());
    out.extend_from_slice(&id.replica.to_le_bytes());
    out
}

fn proof(secret: &[u8], label: &[u8], first: &[u8], second: &[u8], id: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.update(id);
    mac
}

fn check_secret(secret: &[u8]) -> Result<()> {
    if secret.is_empty() {
        return Err(Error::Config(
            "the job secret is empty; give every worker of the job the same non-empty secret"
                .into(),
        ));
    }
    Ok(())
}

fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| {
        Error::Io(io::Error::other(format!(
            "no randomness for a handshake nonce: {e}"
        )))
    })?;
    Ok(n)
}

/// Read exactly `buf.len()` bytes of the handshake step `what`, naming the step on failure.
/// I/O errors keep their kind (a `TimedOut`/`WouldBlock` from a socket timeout stays one) so
/// the caller can tell a silent peer from a refused one.
fn read_step<S: Read>(stream: &mut S, buf: &mut [u8], what: &str) -> Result<()> {
    stream.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => Error::Handshake(format!(
            "the peer closed the connection while sending {what}"
        )),
        kind => Error::Io(io::Error::new(
            kind,
            format!("handshake: reading {what}: {e}"),
        )),
    })
}

fn write_step<S: Write>(stream: &mut S, bytes: &[u8], what: &str) -> Result<()> {
    stream
        .write_all(bytes)
        .and_then(|()| stream.flush())
        .map_err(|e| {
            Error::Io(io::Error::new(
                e.kind(),
                format!("handshake: sending {what}: {e}"),
            ))
        })
}

fn check_preamble(buf: &[u8], who: &str) -> Result<()> {
    let magic = le_u32(buf, 0);
    if magic != MAGIC {
        return Err(Error::Handshake(format!(
            "the {who} sent {magic:#010x} instead of tandem's magic {MAGIC:#010x}: it does not \
             speak tandem's wire protocol"
        )));
    }
    let version = le_u16(buf, 4);
    if version != VERSION {
        return Err(Error::Handshake(format!(
            "the {who} speaks wire version {version}, this build speaks {VERSION}; run the same \
             tandem version on every worker"
        )));
    }
    Ok(())
}

/// Client side: proves knowledge of the per-job secret (challenge-response, HMAC-SHA256 over
/// the server's nonce, job and identity; constant-time compare). Err(Error::Handshake) if
/// refused. The server proves knowledge of the secret back, so a client never streams data
/// into an impostor.
///
/// Exchange (all integers little-endian):
/// 1. server → client: `magic u32 | version u16 | server_nonce [32]`
/// 2. client → server: `magic u32 | version u16 | job_len u16 | job | task u32 |
///    partition u32 | replica u32 | client_nonce [32] |
///    HMAC(secret, client label | server_nonce | client_nonce | identity)`
/// 3. server → client: `0 | HMAC(secret, server label | client_nonce | server_nonce |
///    identity)` to accept, or `1 | reason_len u16 | reason` to refuse.
pub fn client_handshake<S: Read + Write>(
    stream: &mut S,
    me: &Identity,
    secret: &[u8],
) -> Result<()> {
    check_secret(secret)?;
    if me.job.len() > MAX_JOB_ID_LEN {
        return Err(Error::Config(format!(
            "job id of {} bytes is longer than the {MAX_JOB_ID_LEN} bytes the handshake allows",
            me.job.len()
        )));
    }
    let mut hello = [0u8; 6 + NONCE_LEN];
    // A server closes without a hello only when it is going away (stopping, or its
    // process dying with the connection still in its backlog); one that refuses says
    // why. So an end of stream here is not a refusal: the caller may dial again.
    stream.read_exact(&mut hello).map_err(|e| {
        let what = if e.kind() == io::ErrorKind::UnexpectedEof {
            "the peer closed the connection before its hello (it is stopping or gone)".to_owned()
        } else {
            format!("handshake: reading its hello: {e}")
        };
        Error::Io(io::Error::new(e.kind(), what))
    })?;
    check_preamble(&hello, "server")?;
    let server_nonce = &hello[6..];
    let client_nonce = nonce()?;
    let id = identity_bytes(me);
    let tag = proof(secret, CLIENT_LABEL, server_nonce, &client_nonce, &id)
        .finalize()
        .into_bytes();
    let mut msg = Vec::with_capacity(6 + id.len() + NONCE_LEN + MAC_LEN);
    msg.extend_from_slice(&MAGIC.to_le_bytes());
    msg.extend_from_slice(&VERSION.to_le_bytes());
    msg.extend_from_slice(&id);
    msg.extend_from_slice(&client_nonce);
    msg.extend_from_slice(&tag);
    write_step(stream, &msg, "the client proof")?;

    let mut status = [0u8; 1];
    read_step(stream, &mut status, "the handshake verdict")?;
    match status[0] {
        STATUS_ACCEPT => {
            let mut server_tag = [0u8; MAC_LEN];
            read_step(stream, &mut server_tag, "the server proof")?;
            proof(secret, SERVER_LABEL, &client_nonce, server_nonce, &id)
                .verify_slice(&server_tag)
                .map_err(|_| {
                    Error::Handshake(format!(
                        "the server accepted job {:?} but could not prove it knows the job \
                         secret: it is not a worker of this job",
                        me.job
                    ))
                })
        }
        STATUS_REJECT => {
            let mut len = [0u8; 2];
            read_step(stream, &mut len, "the reject reason")?;
            let len = usize::from(u16::from_le_bytes(len));
            if len > MAX_REASON_LEN {
                return Err(Error::Handshake(format!(
                    "the server refused the connection with an over-long reason ({len} bytes)"
                )));
            }
            let mut reason = vec![0u8; len];
            read_step(stream, &mut reason, "the reject reason")?;
            Err(Error::Handshake(format!(
                "the server refused the connection: {}",
                String::from_utf8_lossy(&reason)
            )))
        }
        other => Err(Error::Handshake(format!(
            "the server answered with status byte {other:#04x} (expected 0 = accept, 1 = reject)"
        ))),
    }
}

/// Server side: sends a fresh nonce, checks the client's proof and job id; on failure tells
/// the client why (one short reject message) and returns Err(Error::Handshake(..)). Does not
/// hang forever on a silent peer when the caller has set socket timeouts: a read that times
/// out (`WouldBlock`/`TimedOut`) is returned as [`Error::Io`] with that kind.
pub fn server_handshake<S: Read + Write>(
    stream: &mut S,
    job: &str,
    secret: &[u8],
) -> Result<Identity> {
    check_secret(secret)?;
    let server_nonce = nonce()?;
    let mut hello = Vec::with_capacity(6 + NONCE_LEN);
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&server_nonce);
    write_step(stream, &hello, "the server hello")?;

    let mut pre = [0u8; 8];
    read_step(stream, &mut pre, "the client preamble")?;
    if let Err(e) = check_preamble(&pre, "client") {
        return Err(reject(stream, e));
    }
    let job_len = usize::from(le_u16(&pre, 6));
    if job_len > MAX_JOB_ID_LEN {
        let msg = format!("job id of {job_len} bytes exceeds {MAX_JOB_ID_LEN}");
        return Err(reject(stream, Error::Handshake(msg)));
    }
    let mut rest = vec![0u8; job_len + 12 + NONCE_LEN + MAC_LEN];
    read_step(stream, &mut rest, "the client identity")?;
    let Ok(peer_job) = std::str::from_utf8(&rest[..job_len]) else {
        return Err(reject(
            stream,
            Error::Handshake("job id is not valid UTF-8".into()),
        ));
    };
    let ids = &rest[job_len..job_len + 12];
    let peer = Identity {
        job: peer_job.to_owned(),
        task: le_u32(ids, 0),
        partition: le_u32(ids, 4),
        replica: le_u32(ids, 8),
    };
    let client_nonce = &rest[job_len + 12..job_len + 12 + NONCE_LEN];
    let tag = &rest[job_len + 12 + NONCE_LEN..];
    if peer.job != job {
        let msg = format!("peer belongs to job {:?}, this is job {job:?}", peer.job);
        return Err(reject(stream, Error::Handshake(msg)));
    }
    let id = identity_bytes(&peer);
    if proof(secret, CLIENT_LABEL, &server_nonce, client_nonce, &id)
        .verify_slice(tag)
        .is_err()
    {
        let msg = format!(
            "peer (task {}, partition {}, replica {}) failed to prove the secret of job {job:?}",
            peer.task, peer.partition, peer.replica
        );
        return Err(reject(stream, Error::Handshake(msg)));
    }
    let server_tag = proof(secret, SERVER_LABEL, client_nonce, &server_nonce, &id)
        .finalize()
        .into_bytes();
    let mut accept = Vec::with_capacity(1 + MAC_LEN);
    accept.push(STATUS_ACCEPT);
    accept.extend_from_slice(&server_tag);
    write_step(stream, &accept, "the handshake acceptance")?;
    Ok(peer)
}

/// Tell the client why it is refused (best effort: it may already be gone), and return the
/// error for the server's caller.
fn reject<S: Write>(stream: &mut S, err: Error) -> Error {
    let reason = match &err {
        Error::Handshake(msg) => msg.as_str(),
        _ => "handshake failed",
    };
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = &reason.as_bytes()[..end];
    let mut msg = Vec::with_capacity(3 + reason.len());
    msg.push(STATUS_REJECT);
    msg.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    msg.extend_from_slice(reason);
    let _ = stream.write_all(&msg).and_then(|()| stream.flush());
    err
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    fn ident(job: &str) -> Identity {
        Identity {
            job: job.into(),
            task: 3,
            partition: 1,
            replica: 2,
        }
    }

    /// One end of an in-memory duplex pipe.
    struct Pipe {
        rx: mpsc::Receiver<Vec<u8>>,
        tx: mpsc::Sender<Vec<u8>>,
        pending: Vec<u8>,
        timeout: Duration,
    }

    fn pipe_pair() -> (Pipe, Pipe) {
        let (atx, brx) = mpsc::channel();
        let (btx, arx) = mpsc::channel();
        let t = Duration::from_secs(5);
        (
            Pipe {
                rx: arx,
                tx: atx,
                pending: Vec::new(),
                timeout: t,
            },
            Pipe {
                rx: brx,
                tx: btx,
                pending: Vec::new(),
                timeout: t,
            },
        )
    }

    impl Read for Pipe {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.pending.is_empty() {
                match self.rx.recv_timeout(self.timeout) {
                    Ok(bytes) => self.pending = bytes,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        return Err(io::ErrorKind::TimedOut.into())
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(0),
                }
            }
            let n = buf.len().min(self.pending.len());
            buf[..n].copy_from_slice(&self.pending[..n]);
            self.pending.drain(..n);
            Ok(n)
        }
    }

    impl Write for Pipe {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.tx
                .send(buf.to_vec())
                .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        (client, server)
    }

    /// Run both sides; returns (client result, server result).
    fn run<S: Read + Write + Send + 'static>(
        mut client: S,
        mut server: S,
        client_job: &str,
        client_secret: &'static [u8],
        server_secret: &'static [u8],
    ) -> (Result<()>, Result<Identity>) {
        let me = ident(client_job);
        let c = std::thread::spawn(move || client_handshake(&mut client, &me, client_secret));
        let s = server_handshake(&mut server, "job-a", server_secret);
        drop(server);
        (c.join().unwrap(), s)
    }

    fn check_outcomes<S: Read + Write + Send + 'static>(pair: impl Fn() -> (S, S)) {
        let (c, s) = pair();
        let (cr, sr) = run(c, s, "job-a", b"s3cret", b"s3cret");
        cr.unwrap();
        assert_eq!(sr.unwrap(), ident("job-a"));

        let (c, s) = pair();
        let (cr, sr) = run(c, s, "job-a", b"wrong", b"s3cret");
        let msg = sr.unwrap_err().to_string();
        assert!(msg.contains("failed to prove the secret"), "{msg}");
        let msg = cr.unwrap_err().to_string();
        assert!(
            msg.contains("refused") && msg.contains("failed to prove"),
            "{msg}"
        );

        let (c, s) = pair();
        let (cr, sr) = run(c, s, "job-b", b"s3cret", b"s3cret");
        assert!(
            matches!(sr, Err(Error::Handshake(ref m)) if m.contains("\"job-b\"")),
            "{sr:?}"
        );
        assert!(
            matches!(cr, Err(Error::Handshake(ref m)) if m.contains("job-a")),
            "{cr:?}"
        );

        // A client that answers the hello with garbage is refused with a reason.
        let (mut c, mut s) = pair();
        let garbage = std::thread::spawn(move || {
            let mut hello = [0u8; 6 + NONCE_LEN];
            c.read_exact(&mut hello).unwrap();
            c.write_all(&[0x5A; 200]).unwrap();
            let mut status = [0u8; 1];
            c.read_exact(&mut status).unwrap();
            status[0]
        });
        let err = server_handshake(&mut s, "job-a", b"s3cret").unwrap_err();
        assert!(
            matches!(err, Error::Handshake(ref m) if m.contains("magic")),
            "{err}"
        );
        assert_eq!(garbage.join().unwrap(), STATUS_REJECT);
    }

    #[test]
    fn handshake_over_pipes() {
        check_outcomes(pipe_pair);
    }

    #[test]
    fn handshake_over_tcp() {
        check_outcomes(tcp_pair);
    }

    #[test]
    fn server_rejects_garbage_and_client_rejects_impostor() {
        let (mut c, mut s) = tcp_pair();
        let garbage = std::thread::spawn(move || {
            let mut hello = [0u8; 38];
            c.read_exact(&mut hello).unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut reply = Vec::new();
            let _ = c.read_to_end(&mut reply);
            reply
        });
        let err = server_handshake(&mut s, "job-a", b"k").unwrap_err();
        assert!(err.to_string().contains("does not speak tandem"), "{err}");
        drop(s);
        let reply = garbage.join().unwrap();
        assert_eq!(reply[0], STATUS_REJECT);

        // A server that does not know the secret cannot fake acceptance.
        let (mut c, mut s) = tcp_pair();
        let impostor = std::thread::spawn(move || {
            let mut hello = vec![];
            hello.extend_from_slice(&MAGIC.to_le_bytes());
            hello.extend_from_slice(&VERSION.to_le_bytes());
            hello.extend_from_slice(&[7u8; 32]);
            s.write_all(&hello).unwrap();
            let mut proof = vec![0u8; 8 + 5 + 12 + 64];
            s.read_exact(&mut proof).unwrap();
            s.write_all(&[STATUS_ACCEPT]).unwrap();
            s.write_all(&[0u8; 32]).unwrap();
        });
        let err = client_handshake(&mut c, &ident("job-a"), b"k").unwrap_err();
        assert!(err.to_string().contains("could not prove"), "{err}");
        impostor.join().unwrap();

        // A non-tandem server.
        let (mut c, mut s) = tcp_pair();
        s.write_all(&[0x42; 64]).unwrap();
        let err = client_handshake(&mut c, &ident("job-a"), b"k").unwrap_err();
        assert!(
            matches!(err, Error::Handshake(ref m) if m.contains("magic")),
            "{err}"
        );
    }

    #[test]
    fn a_server_gone_before_its_hello_is_no_refusal() {
        // A server going away closes without a hello: an I/O error the dialler retries,
        // not a handshake refusal it gives up on.
        let (mut c, s) = tcp_pair();
        drop(s);
        let err = client_handshake(&mut c, &ident("job-a"), b"k").unwrap_err();
        assert!(
            matches!(err, Error::Io(ref e) if e.kind() == io::ErrorKind::UnexpectedEof),
            "{err}"
        );
        assert!(err.to_string().contains("before its hello"), "{err}");
    }

    #[test]
    fn handshake_field_limits() {
        let (mut c, _s) = tcp_pair();
        let long = ident(&"j".repeat(MAX_JOB_ID_LEN + 1));
        assert!(matches!(
            client_handshake(&mut c, &long, b"k"),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            client_handshake(&mut c, &ident("a"), b""),
            Err(Error::Config(_))
        ));

        let (mut c, mut s) = tcp_pair();
        let liar = std::thread::spawn(move || {
            let mut hello = [0u8; 38];
            c.read_exact(&mut hello).unwrap();
            let mut msg = MAGIC.to_le_bytes().to_vec();
            msg.extend_from_slice(&VERSION.to_le_bytes());
            msg.extend_from_slice(&u16::MAX.to_le_bytes());
            c.write_all(&msg).unwrap();
            let mut reply = Vec::new();
            let _ = c.read_to_end(&mut reply);
            reply
        });
        let err = server_handshake(&mut s, "job-a", b"k").unwrap_err();
        assert!(err.to_string().contains("65535 bytes exceeds 256"), "{err}");
        drop(s);
        assert_eq!(liar.join().unwrap()[0], STATUS_REJECT);
    }

    #[test]
    fn silent_peer_times_out() {
        let (_c, mut s) = tcp_pair();
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let start = Instant::now();
        match server_handshake(&mut s, "job-a", b"k") {
            Err(Error::Io(e)) => assert!(
                matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ),
                "{e}"
            ),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(3));

        let (mut c, _s) = pipe_pair();
        c.timeout = Duration::from_millis(100);
        assert!(matches!(
            client_handshake(&mut c, &ident("job-a"), b"k"),
            Err(Error::Io(ref e)) if e.kind() == io::ErrorKind::TimedOut
        ));
    }
}
