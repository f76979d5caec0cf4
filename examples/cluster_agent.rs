//! The agent of one host of the soft-RoCE cluster (`scripts/rxe-cluster.sh`): it runs inside a
//! QEMU guest and carries out, for the test process on the machine that booted the guests,
//! commands that start and steer programs on this host. It talks over a virtio-serial port, not
//! the network, so the faults a scenario injects into the rails never cut the test off from
//! its hosts.
//!
//!     cluster_agent PORT_DEVICE
//!
//! One line per message, each starting with a tag the test chose for one program:
//!
//! - `<tag> SPAWN <shell command>`: runs the command with `bash -c` at normal priority;
//! - `<tag> RUN <shell command>`: the same at the agent's own priority (the host's script starts
//!   it at a high one), for the short commands that inject faults and read counters: on a
//!   guest whose one CPU is busy moving RDMA traffic they still run when asked;
//! - `<tag> IN <line>`: writes the line to that program's standard input;
//! - `<tag> CLOSE`: closes its standard input;
//! - `<tag> KILL <signal number>`: signals it;
//! - `<tag> PING`: answered `<tag> PONG <host name> <this host's CLOCK_REALTIME in ns>` at once,
//!   so the test can map this host's clock onto its own.
//!
//! What comes back: `<tag> OUT <line>` and `<tag> ERR <line>` for each line the program prints
//! on standard output and standard error, `<tag> EXIT <status>` when it ended (128 + N when
//! killed by signal N), `<tag> FAIL <why>` when a command could not be carried out.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};

/// Where the agent's replies go: the serial port, shared by every program's reader thread.
#[derive(Clone)]
struct Port(Arc<Mutex<File>>);

impl Port {
    /// Sends one line. A line never contains a newline of its own, so the test can split on it.
    fn send(&self, tag: &str, kind: &str, text: &str) {
        let line = format!("{tag} {kind} {}\n", text.replace(['\n', '\r'], " "));
        if let Ok(mut f) = self.0.lock() {
            let _ = f.write_all(line.as_bytes());
            let _ = f.flush();
        }
    }
}

/// A program the agent started.
struct Program {
    child: Arc<Mutex<Child>>,
    stdin: Option<ChildStdin>,
}

/// Forwards each line of `from` as `<tag> <kind> <line>`.
fn forward(port: Port, tag: String, kind: &'static str, from: impl Read + Send + 'static) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            port.send(&tag, kind, &line);
        }
    });
}

fn spawn(port: &Port, tag: &str, command: &str, normal_priority: bool) -> Result<Program, String> {
    let mut cmd = Command::new("bash");
    cmd.args(["-c", command]);
    if normal_priority {
        // SAFETY: setpriority is async-signal-safe and touches only the child being started.
        unsafe {
            cmd.pre_exec(|| {
                libc::setpriority(libc::PRIO_PROCESS, 0, 0);
                Ok(())
            })
        };
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start bash: {e}"))?;
    let stdin = child.stdin.take();
    if let Some(out) = child.stdout.take() {
        forward(port.clone(), tag.to_string(), "OUT", out);
    }
    if let Some(err) = child.stderr.take() {
        forward(port.clone(), tag.to_string(), "ERR", err);
    }
    let child = Arc::new(Mutex::new(child));
    let (waited, port, tag) = (child.clone(), port.clone(), tag.to_string());
    std::thread::spawn(move || {
        // Polls rather than blocks in wait(), so KILL can take the lock meanwhile.
        loop {
            let status = match waited.lock() {
                Ok(mut c) => c.try_wait(),
                Err(_) => return,
            };
            match status {
                Ok(Some(s)) => {
                    let code = s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0));
                    // Give the reader threads a moment to forward the program's last lines first.
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    port.send(&tag, "EXIT", &code.to_string());
                    return;
                }
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(5)),
                Err(e) => {
                    port.send(&tag, "EXIT", &format!("255 wait failed: {e}"));
                    return;
                }
            }
        }
    });
    Ok(Program { child, stdin })
}

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: cluster_agent PORT_DEVICE");
        std::process::exit(2);
    };
    // A virtio port opens only once: one descriptor serves both directions.
    let opened = OpenOptions::new().read(true).write(true).open(&path).and_then(|f| Ok((f.try_clone()?, f)));
    let (reader, writer) = match opened {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!("cluster_agent: cannot open {path}: {e}");
            std::process::exit(1);
        }
    };
    let port = Port(Arc::new(Mutex::new(writer)));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
    port.send("agent", "READY", &host);
    let mut programs: HashMap<String, Program> = HashMap::new();
    let mut reader = BufReader::new(reader);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            // The port reads as ended while no test is connected on the other side: wait for
            // the next one rather than exit.
            Ok(0) => {
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("cluster_agent: reading {path}: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        }
        let line = line.trim_end_matches(['\n', '\r']);
        let mut parts = line.splitn(3, ' ');
        let (Some(tag), Some(verb)) = (parts.next(), parts.next()) else { continue };
        let rest = parts.next().unwrap_or("");
        match verb {
            "PING" => {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                port.send(tag, "PONG", &format!("{host} {}", now.as_nanos()));
            }
            "SPAWN" | "RUN" => match spawn(&port, tag, rest, verb == "SPAWN") {
                Ok(p) => {
                    programs.insert(tag.to_string(), p);
                }
                Err(e) => port.send(tag, "FAIL", &e),
            },
            "IN" => match programs.get_mut(tag).and_then(|p| p.stdin.as_mut()) {
                Some(stdin) => {
                    if let Err(e) = stdin.write_all(format!("{rest}\n").as_bytes()).and_then(|_| stdin.flush()) {
                        port.send(tag, "FAIL", &format!("cannot write to its input: {e}"));
                    }
                }
                None => port.send(tag, "FAIL", "no such program, or its input is closed"),
            },
            "CLOSE" => {
                if let Some(p) = programs.get_mut(tag) {
                    p.stdin = None;
                }
            }
            "KILL" => {
                let sig: i32 = rest.trim().parse().unwrap_or(9);
                match programs.get(tag).and_then(|p| p.child.lock().ok().map(|c| c.id())) {
                    // SAFETY: kill(2) with a pid of a child this agent started and a signal number.
                    Some(pid) => unsafe {
                        libc::kill(pid as i32, sig);
                    },
                    None => port.send(tag, "FAIL", "no such program"),
                }
            }
            other => port.send(tag, "FAIL", &format!("unknown verb {other}")),
        }
    }
}
