//! The byte stream between two replicas: TCP, or a Unix socket when both are on this host.
//!
//! An inbox listens on TCP, and also on an abstract Unix socket named after its TCP
//! address when that address is on the loopback interface (or the wildcard one). A link
//! dialling a loopback address tries the Unix socket first: on this machine it costs
//! about half the kernel time per frame of TCP over loopback (no TCP/IP stack, no
//! softirq), which at r replicas is paid r² times per batch. Everything above the stream
//! — handshake, frames, back-pressure, close — is the same on both. Linux only (abstract
//! names); elsewhere, and whenever the Unix socket cannot be reached, TCP is used.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

/// A connected stream of either kind.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

macro_rules! both {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Stream::Tcp($s) => $e,
            Stream::Unix($s) => $e,
        }
    };
}

impl Stream {
    /// Dial `target`: its Unix socket if it is a loopback address and the inbox offers
    /// one, else TCP (with Nagle off), giving up after `timeout`.
    pub fn connect(target: SocketAddr, timeout: Duration) -> io::Result<Stream> {
        if target.ip().is_loopback() {
            if let Some(s) = connect_local(target) {
                return Ok(Stream::Unix(s));
            }
        }
        let s = TcpStream::connect_timeout(&target, timeout)?;
        s.set_nodelay(true)?;
        Ok(Stream::Tcp(s))
    }

    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        both!(self, s => s.shutdown(how))
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        both!(self, s => s.set_read_timeout(t))
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        both!(self, s => s.set_write_timeout(t))
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        both!(self, s => s.set_nonblocking(on))
    }

    /// Whether the peer has closed or reset the connection, as far as this end can tell
    /// without blocking or taking anything: a peek at the next byte finds the end of the
    /// stream or an error. A peer that went silent with no close (its host cut off) is
    /// not seen; bytes waiting to be read (none come after the handshake) mean it was
    /// there when it sent them.
    pub fn closed_by_peer(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: a one-byte buffer we own, on a descriptor this stream keeps open.
        let n = unsafe {
            libc::recv(
                self.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => peer_gone(io::Error::last_os_error().kind()),
        }
    }

    /// "TCP" or "Unix socket".
    pub fn kind(&self) -> &'static str {
        match self {
            Stream::Tcp(_) => "TCP",
            Stream::Unix(_) => "Unix socket",
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        both!(self, s => s.as_raw_fd())
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A listener of either kind.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// The next connection and a description of its peer.
    pub fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Listener::Tcp(l) => l
                .accept()
                .map(|(s, peer)| (Stream::Tcp(s), peer.to_string())),
            Listener::Unix(l) => l
                .accept()
                .map(|(s, _)| (Stream::Unix(s), "a local Unix socket".to_owned())),
        }
    }
}

/// The address a peer on this host dials to reach a listener bound to `addr`: the
/// loopback address of its family for a wildcard bind, else `addr` itself.
pub fn dialled(addr: SocketAddr) -> SocketAddr {
    if !addr.ip().is_unspecified() {
        return addr;
    }
    let lo: std::net::IpAddr = if addr.is_ipv4() {
        std::net::Ipv4Addr::LOCALHOST.into()
    } else {
        std::net::Ipv6Addr::LOCALHOST.into()
    };
    SocketAddr::new(lo, addr.port())
}

/// The abstract Unix socket name of the inbox listening on TCP `addr`.
fn local_name(addr: SocketAddr) -> String {
    format!("tandem-inbox/{addr}")
}

/// Listen on the Unix socket paired with TCP address `addr` (the actual bound address),
/// if it is a loopback or wildcard address; None where that is not possible.
pub fn listen_local(addr: SocketAddr) -> Option<UnixListener> {
    #[cfg(target_os = "linux")]
    {
        use std::os::linux::net::SocketAddrExt;
        let dialled = dialled(addr);
        if !dialled.ip().is_loopback() {
            return None;
        }
        let name = std::os::unix::net::SocketAddr::from_abstract_name(local_name(dialled)).ok()?;
        UnixListener::bind_addr(&name).ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = addr;
        None
    }
}

fn connect_local(target: SocketAddr) -> Option<UnixStream> {
    #[cfg(target_os = "linux")]
    {
        use std::os::linux::net::SocketAddrExt;
        let name = std::os::unix::net::SocketAddr::from_abstract_name(local_name(target)).ok()?;
        UnixStream::connect_addr(&name).ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = target;
        None
    }
}

/// Wake a thread blocked in `accept` on the Unix socket paired with `addr`.
pub fn poke_local(addr: SocketAddr) -> bool {
    connect_local(addr).is_some()
}

/// The I/O errors of a connection whose peer closed or reset it.
pub(crate) fn peer_gone(kind: io::ErrorKind) -> bool {
    matches!(
        kind,
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn loopback_peers_meet_on_the_unix_socket_and_others_on_tcp() {
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        // No Unix socket offered: TCP.
        let s = Stream::connect(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(s.kind(), "TCP");
        drop(s);
        // Offered: the Unix socket, and bytes flow both ways.
        let local = Listener::Unix(listen_local(addr).expect("abstract Unix socket"));
        let mut s = Stream::connect(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(s.kind(), "Unix socket");
        let (mut served, peer) = local.accept().unwrap();
        assert_eq!(peer, "a local Unix socket");
        s.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        served.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        served.write_all(b"pong").unwrap();
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"pong");
        // A second listener for the same address is refused (the name is taken), and a
        // wildcard-bound inbox is reached through 127.0.0.1.
        assert!(listen_local(addr).is_none());
        let any = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = any.local_addr().unwrap().port();
        let _l = listen_local(any.local_addr().unwrap()).expect("wildcard listener");
        let dialled = SocketAddr::from(([127, 0, 0, 1], port));
        assert_eq!(
            Stream::connect(dialled, Duration::from_secs(5))
                .unwrap()
                .kind(),
            "Unix socket"
        );
    }
}
