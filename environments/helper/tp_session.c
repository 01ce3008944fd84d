/*
 * tp-session: the in-container half of termpool's shell tools.
 *
 * Mounted read-only into every task container (/.termpool/bin/tp-session; copied
 * in by put_archive into containers started without the mount) and run through
 * `docker exec`.  It is linked statically so it works in any Linux image, even
 * one that has nothing but `sh`.  All session state lives in files under a
 * session directory inside the container, so a session outlives the Python
 * worker that started it:
 *
 *   DIR/out   everything the command printed (stdout+stderr, or the pty); a
 *             sparse file once it passed the session's output limit
 *   DIR/base  offset below which out was dropped (a hole), when it was
 *   DIR/in    FIFO feeding the command's stdin (non-blocking sessions)
 *   DIR/pid   "<supervisor pid> <supervisor start time> <command pid>"
 *   DIR/rc    exit status, written only after all output is in DIR/out
 *
 * Subcommands (headers are one text line; raw output bytes follow):
 *   spawn DIR PTY WAIT [--limit BYTES] [--max BYTES] -- argv...
 *       WAIT "-": non-blocking; prints "started" or "exists" (DIR is running).
 *       WAIT seconds (<0: no limit): blocking; runs in a scratch dir next to
 *       DIR and prints "done <rc> <dropped>" + output, or "timeout" after it
 *       has moved the still-running command to DIR.
 *       --limit: at most this much output is kept on disk (default 16 MiB,
 *       0: no limit); older output is dropped, the command carries on.
 *   read DIR OFFSET [--if-exited] [--max BYTES]
 *       "<running|exited|missing> <end> <rc> <dropped>" + bytes of out
 *       [OFFSET + dropped, end).  With --if-exited the bytes are sent only
 *       when the command has ended.
 *   write DIR TEXT [--max BYTES]
 *       Sends TEXT+"\n" to the stdin of a running session, then collects the
 *       output until quiet for 0.5 s (5 s at most).  Output that was there
 *       before the write is skipped.  Prints "norun", or
 *       "<running|exited> <start> <end> <capped 0|1> <dropped>" + bytes
 *       [start + dropped, end).
 *   Output is sent newest first: `dropped` counts the bytes of the asked
 *   range that are not sent, because the limit dropped them or --max (the
 *   most bytes to send) left them out.
 *   kill DIR                 -> "killed" or "notrunning"
 *   mkparents PATH           -> create PATH's parent dirs; "<uid> <gid>" of the caller
 *   put PATH < content       -> write a file as put_archive would; "ok" (see cmd_put)
 *   run-timeout SECONDS -- argv...
 *       Runs argv in the foreground in its own process group; after SECONDS
 *       kills the group and exits 124, else exits with argv's status (and
 *       kills what is left of the group, so no straggler holds the output).
 *   setup SESSIONS WORKSPACE UID GID [-- SUBCOMMAND ARGS...]
 *       What installing the helper by archive also did, for a mounted helper:
 *       SESSIONS a directory of mode 1777, WORKSPACE one of mode 0755 owned by
 *       UID:GID (as root); then runs SUBCOMMAND (this binary) in its place.
 *   serve SOCKPATH
 *       A daemon answering the subcommands above over a unix socket, so a tool
 *       call costs a fork instead of a `docker exec` (see cmd_serve).
 * Exit status 2 plus a message on stderr means the helper itself failed.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { ST_MISSING, ST_RUNNING, ST_EXITED };
static const char *const state_names[] = {"missing", "running", "exited"};

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tp-session: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Small files (pid, rc) are read whole; returns length or -1. */
static ssize_t read_small(int dfd, const char *name, char *buf, size_t cap)
{
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    if (n < 0) return -1;
    buf[n] = 0;
    return n;
}

/* Write via a temporary name and rename, so readers never see a half file. */
static void write_small(int dfd, const char *name, const char *text)
{
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%s.tmp", name);
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    write_all(fd, text, strlen(text));
    close(fd);
    renameat(dfd, tmp, dfd, name);
}

/* State letter and start time (field 22) of a process, from /proc. */
static int proc_stat(pid_t pid, char *state, unsigned long long *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may contain spaces */
    if (!p || p[1] != ' ') return -1;
    p += 2;
    *state = *p;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 0;
}

/*
 * A session runs while its supervisor lives.  The start time guards against
 * pid reuse after a container restart; a zombie counts as dead (pid 1 of many
 * images is `sleep infinity`, which never reaps).
 */
static int session_state(int dfd, int *rc)
{
    char buf[128];
    *rc = -1;
    if (dfd < 0) return ST_MISSING;
    if (read_small(dfd, "rc", buf, sizeof buf) > 0) {
        *rc = atoi(buf);
        return ST_EXITED;
    }
    int sup = 0, child = 0;
    unsigned long long start = 0, st_start;
    char st;
    if (read_small(dfd, "pid", buf, sizeof buf) > 0 &&
        sscanf(buf, "%d %llu %d", &sup, &start, &child) == 3 && sup > 0 &&
        proc_stat(sup, &st, &st_start) == 0 && st != 'Z' && st_start == start)
        return ST_RUNNING;
    /* The supervisor may have finished between the two reads. */
    if (read_small(dfd, "rc", buf, sizeof buf) > 0) *rc = atoi(buf);
    return ST_EXITED;
}

static int open_dir(const char *dir)
{
    return open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

static off_t file_size(int fd)
{
    struct stat sb;
    return fstat(fd, &sb) == 0 ? sb.st_size : 0;
}

/* ------------------------------------------------------- the output limit */

#define DEFAULT_LIMIT ((off_t)16 << 20)

/* Where out still has its bytes: everything below was punched out. */
static off_t read_base(int dfd)
{
    char buf[64];
    return dfd >= 0 && read_small(dfd, "base", buf, sizeof buf) > 0 ? (off_t)strtoll(buf, NULL, 10) : 0;
}

/*
 * The supervisor's writes to out.  Past the limit, the oldest output is
 * punched out of the file (a hole: no disk space; offsets stay valid, so
 * readers keep their place) down to half the limit, and DIR/base says where
 * the bytes start again.  base is written before the punch, so a reader that
 * checks it again after reading knows which of its bytes may be zeros.
 */
struct sink {
    int dfd, fd, broken;
    off_t limit, base;
};

static void sink_write(struct sink *s, const char *buf, size_t n)
{
    if (s->broken) return; /* no holes on this filesystem: stop storing output */
    write_all(s->fd, buf, n);
    off_t size = file_size(s->fd);
    if (s->limit <= 0 || size - s->base <= s->limit) return;
    off_t cut = (size - s->limit / 2) & ~(off_t)4095;
    if (cut <= s->base) return;
    char line[32];
    snprintf(line, sizeof line, "%lld\n", (long long)cut);
    write_small(s->dfd, "base", line);
    if (fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, cut) < 0) {
        s->broken = 1;
        return;
    }
    s->base = cut;
}

/* Bytes [from + dropped, from + dropped + len) of out, read into memory. */
struct range {
    off_t dropped;
    size_t len;
    char *data;
};

/* Read [from, to) of out, the newest `max` bytes at most (0: no limit), leaving
 * out what the limit dropped, even while we read.  The caller prints its
 * header, then send_range(). */
static struct range load_range(int dfd, int fd, off_t from, off_t to, off_t max)
{
    struct range r = {0, 0, NULL};
    off_t start = from, base = read_base(dfd);
    if (start < base) start = base;
    if (max > 0 && to - start > max) start = to - max;
    if (start > to) start = from > to ? from : to;
    if (fd < 0 || start >= to || (r.data = malloc((size_t)(to - start))) == NULL) {
        r.dropped = start - from;
        return r;
    }
    while (start + (off_t)r.len < to) {
        ssize_t n = pread(fd, r.data + r.len, (size_t)(to - start) - r.len, start + (off_t)r.len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        r.len += (size_t)n;
    }
    base = read_base(dfd); /* punched while we read: those bytes may be zeros */
    if (base > start) {
        size_t skip = base - start < (off_t)r.len ? (size_t)(base - start) : r.len;
        memmove(r.data, r.data + skip, r.len - skip);
        r.len -= skip;
        start += (off_t)skip;
    }
    r.dropped = start - from;
    return r;
}

static void send_range(struct range *r)
{
    fflush(stdout); /* the header first */
    if (r->len) write_all(1, r->data, r->len);
    free(r->data);
    r->data = NULL;
}

/* "--name VALUE" options of a subcommand, from argv[i] on; stops at "--". */
static off_t option(int argc, char **argv, int i, const char *name, off_t dflt)
{
    for (; i < argc - 1 && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], name) == 0) return (off_t)strtoll(argv[i + 1], NULL, 10);
    return dflt;
}

/* Remove a session directory (it only ever holds plain files and a FIFO). */
static int remove_flat(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            unlinkat(dirfd(d), e->d_name, 0);
    closedir(d);
    return rmdir(dir);
}

/* ------------------------------------------------------------------ spawn */

static void noop_handler(int sig) { (void)sig; }

/* Child side: undo the supervisor's signal setup, then become the command. */
static void exec_command(char **argv, int pty)
{
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL); /* ignored dispositions would survive exec */
    signal(SIGHUP, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    if (pty) setenv("TERM", "xterm", 0); /* what `docker exec -t` would give */
    execvp(argv[0], argv);
    if (errno == ENOENT && strcmp(argv[0], "bash") == 0) {
        argv[0] = "sh"; /* images without bash: `sh -c` is the next best shell */
        execvp(argv[0], argv);
    }
    dprintf(2, "tp-session: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

/*
 * Copy pty output to DIR/out and DIR/in to the pty until the command exits.
 * ppoll() with SIGCHLD unblocked only inside the call gives a race-free wakeup
 * when the child ends.
 */
static int pump_pty(int master, int fifo, struct sink *out, pid_t child, const sigset_t *waitmask)
{
    char buf[65536], in[4096];
    size_t inlen = 0, inpos = 0;
    int status = 0, master_open = 1;
    fcntl(master, F_SETFL, fcntl(master, F_GETFL) | O_NONBLOCK);
    for (;;) {
        pid_t w = waitpid(child, &status, WNOHANG);
        if (w == child || (w < 0 && errno == ECHILD)) break;
        struct pollfd fds[2];
        int n = 0, mi = -1, fi = -1;
        if (master_open) {
            fds[n] = (struct pollfd){master, (short)(POLLIN | (inpos < inlen ? POLLOUT : 0)), 0};
            mi = n++;
        }
        if (inpos >= inlen) {
            fds[n] = (struct pollfd){fifo, POLLIN, 0};
            fi = n++;
        }
        if (ppoll(fds, (nfds_t)n, NULL, waitmask) < 0) continue; /* EINTR: SIGCHLD */
        if (mi >= 0 && (fds[mi].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = read(master, buf, sizeof buf);
            if (r > 0) sink_write(out, buf, (size_t)r);
            else if (r == 0 || (errno != EAGAIN && errno != EINTR)) master_open = 0; /* EIO: slave closed */
        }
        if (mi >= 0 && (fds[mi].revents & POLLOUT) && inpos < inlen) {
            ssize_t r = write(master, in + inpos, inlen - inpos);
            if (r > 0) inpos += (size_t)r;
        }
        if (fi >= 0 && (fds[fi].revents & POLLIN)) {
            ssize_t r = read(fifo, in, sizeof in);
            inpos = 0;
            inlen = r > 0 && master_open ? (size_t)r : 0;
        }
    }
    /*
     * The command has exited, but what it wrote last can still be on its way
     * through the tty layer: keep reading until EIO (nobody holds the slave
     * any more) or until a short quiet spell (a background child holds it),
     * so the tail of the output is never lost.
     */
    double deadline = now() + 2.0;
    while (master_open && now() < deadline) {
        struct pollfd p = {master, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0) break;
        ssize_t r = read(master, buf, sizeof buf);
        if (r > 0) sink_write(out, buf, (size_t)r);
        else if (r == 0 || (errno != EAGAIN && errno != EINTR)) break;
    }
    return status;
}

/*
 * Without a pty the command writes into a pipe (O_NONBLOCK) that we copy to
 * DIR/out, so the limit holds.  Returns once the command has exited and what
 * it wrote is copied; *eof says whether nothing else holds the pipe (a
 * process it left in the background may, and may write later: drain_pipe).
 */
static int pump_pipe(int rd, struct sink *out, pid_t child, const sigset_t *waitmask, int *eof)
{
    char buf[65536];
    int status = 0;
    *eof = 0;
    for (;;) {
        pid_t w = waitpid(child, &status, WNOHANG);
        int exited = w == child || (w < 0 && errno == ECHILD);
        ssize_t r;
        while ((r = read(rd, buf, sizeof buf)) > 0) sink_write(out, buf, (size_t)r);
        if (r == 0) *eof = 1;
        if (exited) return status;
        struct pollfd pf = {rd, POLLIN, 0};
        ppoll(&pf, *eof ? 0 : 1, NULL, waitmask); /* wakes on output or SIGCHLD */
    }
}

/* Copy what background processes still write until none holds the pipe. */
static void drain_pipe(int rd, struct sink *out)
{
    char buf[65536];
    for (;;) {
        struct pollfd pf = {rd, POLLIN, 0};
        if (poll(&pf, 1, -1) < 0 && errno != EINTR) return;
        ssize_t r = read(rd, buf, sizeof buf);
        if (r > 0) sink_write(out, buf, (size_t)r);
        else if (r == 0 || (errno != EAGAIN && errno != EINTR)) return;
    }
}

/* Point stdio at /dev/null: `docker exec` (or the socket client) waits until a
 * detached process has let go of the streams it was started with. */
static void release_stdio(void)
{
    int devnull = open("/dev/null", O_RDWR);
    dup2(devnull, 0);
    dup2(devnull, 1);
    dup2(devnull, 2);
    if (devnull > 2) close(devnull);
}

/* The detached process that owns the command for the life of the session. */
static void supervise(const char *wdir, int pty, int interactive, off_t limit, int ready_fd, char **argv)
{
    release_stdio();
    signal(SIGPIPE, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    sigset_t chld, waitmask;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, &waitmask);
    sigdelset(&waitmask, SIGCHLD);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = noop_handler; /* SIG_DFL would not interrupt ppoll */
    sigaction(SIGCHLD, &sa, NULL);

    /* The directory may be renamed later (blocking -> session): use a dir fd. */
    int dfd = open_dir(wdir);
    int outfd = openat(dfd, "out", O_WRONLY | O_APPEND | O_CLOEXEC);
    if (dfd < 0 || outfd < 0) _exit(1);
    struct sink out = {dfd, outfd, 0, limit, 0};
    pid_t child;
    int master = -1, fifo = -1, pipefd[2] = {-1, -1};
    if (pty) {
        /* O_RDWR: we hold a writer ourselves, so the FIFO never reports EOF. */
        fifo = openat(dfd, "in", O_RDWR | O_NONBLOCK | O_CLOEXEC);
        struct winsize ws = {.ws_row = 24, .ws_col = 80};
        child = forkpty(&master, NULL, NULL, &ws);
        if (child == 0) exec_command(argv, 1);
    } else {
        if (pipe2(pipefd, O_CLOEXEC) < 0) _exit(1);
        fcntl(pipefd[0], F_SETFL, O_NONBLOCK);
        child = fork();
        if (child == 0) {
            setsid(); /* own session: `kill` can find everything it started */
            int in = interactive ? openat(dfd, "in", O_RDWR) : open("/dev/null", O_RDONLY);
            dup2(in, 0);
            if (in > 2) close(in);
            /* One pipe for both: merged in arrival order. */
            dup2(pipefd[1], 1);
            dup2(pipefd[1], 2);
            exec_command(argv, 0);
        }
        close(pipefd[1]);
    }
    if (child < 0) _exit(1);

    char line[128];
    unsigned long long start = 0;
    char st;
    proc_stat(getpid(), &st, &start);
    snprintf(line, sizeof line, "%d %llu %d\n", (int)getpid(), start, (int)child);
    write_small(dfd, "pid", line);
    write_all(ready_fd, "R", 1);

    int status = 0, eof = 1;
    if (pty) {
        status = pump_pty(master, fifo, &out, child, &waitmask);
    } else {
        status = pump_pipe(pipefd[0], &out, child, &waitmask, &eof);
    }
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    snprintf(line, sizeof line, "%d\n", rc);
    write_small(dfd, "rc", line); /* last: rc present => out is complete */
    /* Background leftovers still hold the pipe: a child of ours keeps copying
     * their output (under the limit; into nothing once a blocking command's
     * scratch dir is gone), so they never get EPIPE, and we end now. */
    if (!eof && fork() == 0) {
        close(ready_fd);
        drain_pipe(pipefd[0], &out);
        _exit(0);
    }
    _exit(0); /* closing ready_fd tells a waiting foreground we are done */
}

static int cmd_spawn(int argc, char **argv)
{
    int dash = 5;
    while (dash < argc && strcmp(argv[dash], "--") != 0) dash++;
    if (argc < 7 || dash >= argc - 1)
        die("usage: spawn DIR PTY(0|1) WAIT(-|seconds) [--limit BYTES] [--max BYTES] -- argv...");
    const char *dir = argv[2];
    int pty = atoi(argv[3]);
    int blocking = strcmp(argv[4], "-") != 0;
    double timeout = blocking ? strtod(argv[4], NULL) : 0;
    off_t limit = option(argc, argv, 5, "--limit", DEFAULT_LIMIT);
    off_t max = option(argc, argv, 5, "--max", 0);
    char **cmd = argv + dash + 1;
    char wdir[4096];
    int rc;

    if (blocking) {
        /* Scratch dir: a running session with the same id stays untouched
         * unless this command outlives its timeout. */
        snprintf(wdir, sizeof wdir, "%s.run.%d", dir, (int)getpid());
        remove_flat(wdir);
    } else {
        int dfd = open_dir(dir);
        int st = session_state(dfd, &rc);
        if (dfd >= 0) close(dfd);
        if (st == ST_RUNNING) {
            puts("exists");
            return 0;
        }
        if (remove_flat(dir) < 0) die("cannot remove old session %s: %s", dir, strerror(errno));
        snprintf(wdir, sizeof wdir, "%s", dir);
    }
    if (mkdir(wdir, 0755) < 0) die("mkdir %s: %s", wdir, strerror(errno));
    int dfd = open_dir(wdir);
    int outfd = openat(dfd, "out", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (dfd < 0 || outfd < 0) die("cannot create %s/out: %s", wdir, strerror(errno));
    close(outfd);
    if (!blocking && mkfifoat(dfd, "in", 0600) < 0) die("mkfifo %s/in: %s", wdir, strerror(errno));

    /* The supervisor holds the write end until it exits: EOF == finished. */
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) die("pipe: %s", strerror(errno));
    /* The supervisor gets its own session (no terminal, no signals meant for
     * this exec) and outlives us when we return early.  No double fork: while
     * we wait for it we are its parent and reap it, so a blocking command
     * leaves no zombie behind (pid 1 of many images never reaps). */
    pid_t sup = fork();
    if (sup < 0) die("fork: %s", strerror(errno));
    if (sup == 0) {
        close(p[0]);
        setsid();
        supervise(wdir, pty, !blocking, limit, p[1], cmd);
    }
    close(p[1]);
    char c;
    ssize_t n;
    while ((n = read(p[0], &c, 1)) < 0 && errno == EINTR) {}
    if (n != 1) die("the session supervisor failed to start");

    if (!blocking) {
        puts("started");
        return 0;
    }
    /* Wait for EOF on the pipe.  A byte on stderr every few seconds keeps an
     * API client that applies a read timeout to the exec stream from giving up
     * on a long, silent command (the docker SDK turns that timeout off).  Not
     * when stderr is stdout (the serve socket): the byte would land in the
     * output, and that client reads without a timeout. */
    struct stat so, se;
    int keepalive = !(fstat(1, &so) == 0 && fstat(2, &se) == 0 && so.st_dev == se.st_dev && so.st_ino == se.st_ino);
    double deadline = timeout < 0 ? -1 : now() + timeout;
    for (;;) {
        double left = deadline < 0 ? 5.0 : deadline - now();
        if (left <= 0) break;
        struct pollfd pf = {p[0], POLLIN, 0};
        int r = poll(&pf, 1, (int)((left < 5.0 ? left : 5.0) * 1000) + 1);
        if (r > 0) {
            n = read(p[0], &c, 1);
            if (n == 0) {
                while (waitpid(sup, NULL, 0) < 0 && errno == EINTR) {}
                int sdfd = open_dir(wdir);
                session_state(sdfd, &rc);
                int fd = openat(sdfd, "out", O_RDONLY | O_CLOEXEC);
                struct range out = load_range(sdfd, fd, 0, fd < 0 ? 0 : file_size(fd), max);
                printf("done %d %lld\n", rc, (long long)out.dropped);
                send_range(&out);
                remove_flat(wdir);
                return 0;
            }
        } else if (r == 0 && keepalive) {
            write_all(2, ".", 1);
        }
    }
    /* Timed out: the command carries on as session DIR.  A session already
     * running under that id is moved aside, left running, and forgotten. */
    int odfd = open_dir(dir);
    int st = session_state(odfd, &rc);
    if (odfd >= 0) close(odfd);
    if (st == ST_RUNNING) {
        char aside[4200];
        snprintf(aside, sizeof aside, "%s.old.%d", dir, (int)getpid());
        rename(dir, aside);
    } else {
        remove_flat(dir);
    }
    if (rename(wdir, dir) < 0) die("rename %s: %s", wdir, strerror(errno));
    puts("timeout");
    return 0;
}

/* ------------------------------------------------------------------- read */

static int cmd_read(int argc, char **argv)
{
    if (argc < 4) die("usage: read DIR OFFSET [--if-exited] [--max BYTES]");
    off_t offset = strtoll(argv[3], NULL, 10);
    int if_exited = argc > 4 && strcmp(argv[4], "--if-exited") == 0;
    off_t max = option(argc, argv, 4, "--max", 0);
    int rc, dfd = open_dir(argv[2]);
    /* State first: "exited" then guarantees every byte is already in out. */
    int st = session_state(dfd, &rc);
    int fd = dfd < 0 ? -1 : openat(dfd, "out", O_RDONLY | O_CLOEXEC);
    if (fd < 0) st = ST_MISSING;
    off_t end = fd < 0 ? 0 : file_size(fd);
    struct range out = {0, 0, NULL};
    if (fd >= 0 && !(if_exited && st == ST_RUNNING)) out = load_range(dfd, fd, offset, end, max);
    printf("%s %lld %d %lld\n", state_names[st], (long long)end, rc, (long long)out.dropped);
    send_range(&out);
    return 0;
}

/* ------------------------------------------------------------------ write */

/* Move a cut point back to the start of a UTF-8 sequence that is cut short. */
static off_t utf8_boundary(int fd, off_t end)
{
    unsigned char b[4];
    off_t from = end > 3 ? end - 3 : 0;
    ssize_t n = pread(fd, b, (size_t)(end - from), from);
    for (ssize_t i = n - 1; i >= 0; i--) {
        if ((b[i] & 0xC0) == 0x80) continue; /* continuation byte */
        int need = b[i] >= 0xF0 ? 4 : b[i] >= 0xE0 ? 3 : b[i] >= 0xC0 ? 2 : 1;
        return n - i < need ? from + i : end;
    }
    return end;
}

static int cmd_write(int argc, char **argv)
{
    if (argc < 4) die("usage: write DIR TEXT [--max BYTES]");
    off_t max = option(argc, argv, 4, "--max", 0);
    int rc, dfd = open_dir(argv[2]);
    int outfd = dfd < 0 ? -1 : openat(dfd, "out", O_RDONLY | O_CLOEXEC);
    if (session_state(dfd, &rc) != ST_RUNNING || outfd < 0) {
        puts("norun");
        return 0;
    }
    /* ENXIO here means nobody reads the FIFO: not a live interactive session. */
    int in = openat(dfd, "in", O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (in < 0) {
        puts("norun");
        return 0;
    }
    off_t start = utf8_boundary(outfd, file_size(outfd)); /* skip unviewed output */
    size_t len = strlen(argv[3]);
    char *text = malloc(len + 1);
    if (!text) die("out of memory");
    memcpy(text, argv[3], len);
    text[len++] = '\n';
    double t0 = now();
    size_t done = 0;
    while (done < len && now() - t0 < 5.0) {
        ssize_t n = write(in, text + done, len - done);
        if (n > 0) done += (size_t)n;
        else if (n < 0 && errno == EAGAIN) {
            struct pollfd pf = {in, POLLOUT, 0};
            poll(&pf, 1, 50);
        } else if (n < 0 && errno != EINTR) break;
    }
    free(text);
    close(in);

    /* Collect until quiet for 0.5 s, the process ended, or 5 s passed. */
    off_t seen = file_size(outfd);
    double last = now();
    int st = ST_RUNNING, capped = 0;
    for (;;) {
        sleep_s(0.02);
        st = session_state(dfd, &rc);
        if (st != ST_RUNNING) break;
        off_t size = file_size(outfd);
        double t = now();
        if (size != seen) {
            seen = size;
            last = t;
        }
        if (t - last >= 0.5) break;
        if (t - t0 >= 5.0) {
            capped = 1;
            break;
        }
    }
    off_t end = file_size(outfd);
    struct range out = load_range(dfd, outfd, start, end, max);
    printf("%s %lld %lld %d %lld\n", state_names[st], (long long)start, (long long)end, capped,
           (long long)out.dropped);
    send_range(&out);
    return 0;
}

/* ------------------------------------------------------------------- kill */

/* Kill every process in the command's session (it is a session leader), which
 * also catches jobs an interactive shell moved to other process groups. */
static int cmd_kill(int argc, char **argv)
{
    if (argc < 3) die("usage: kill DIR");
    int rc, dfd = open_dir(argv[2]);
    char buf[128];
    int sup = 0, child = 0;
    unsigned long long start;
    if (session_state(dfd, &rc) != ST_RUNNING || read_small(dfd, "pid", buf, sizeof buf) <= 0 ||
        sscanf(buf, "%d %llu %d", &sup, &start, &child) != 3 || child <= 0) {
        puts("notrunning");
        return 0;
    }
    kill(-child, SIGKILL);
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        pid_t pid = (pid_t)atoi(e->d_name);
        if (pid > 0 && pid != sup && getsid(pid) == child) kill(pid, SIGKILL);
    }
    if (d) closedir(d);
    /* Give the supervisor time to drain the output and record the end. */
    double t0 = now();
    while (session_state(dfd, &rc) == ST_RUNNING && now() - t0 < 3.0) sleep_s(0.01);
    puts("killed");
    return 0;
}

/* --------------------------------------------------------------- mkparents */

/* Before a file is written by put_archive for a non-root user: create its
 * missing parent directories as that user, refuse a path that is a directory
 * (put_archive would replace the whole directory with the file), and report
 * the numeric ids the archive's file must carry.  0, or -1 and why in msg. */
static int make_parents(const char *target, char *msg, size_t cap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s", target);
    for (char *p = strchr(path + 1, '/'); p; p = strchr(p + 1, '/')) {
        *p = 0;
        if (mkdir(path, 0755) < 0 && errno != EEXIST) {
            snprintf(msg, cap, "cannot create directory '%s': %s", path, strerror(errno));
            return -1;
        }
        *p = '/';
    }
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        snprintf(msg, cap, "Is a directory: '%s'", path);
        return -1;
    }
    return 0;
}

static int cmd_mkparents(int argc, char **argv)
{
    char msg[4400];
    if (argc < 3 || argv[2][0] != '/') die("usage: mkparents /ABSOLUTE/PATH");
    if (make_parents(argv[2], msg, sizeof msg) < 0) {
        fprintf(stderr, "%s\n", msg);
        return 1;
    }
    printf("%d %d\n", (int)getuid(), (int)getgid());
    return 0;
}

/* ------------------------------------------------------------------ setup */

/* A directory at path with exactly this mode and owner, as extracting an
 * archive's directory entry makes it: whatever else is there (a file, a
 * symlink) is replaced, an existing directory is kept. */
static int ensure_dir(const char *path, mode_t mode, uid_t uid, gid_t gid)
{
    struct stat sb;
    if (lstat(path, &sb) == 0 && !S_ISDIR(sb.st_mode) && unlink(path) < 0) return -1;
    if (mkdir(path, mode) < 0 && errno != EEXIST) return -1;
    if (lchown(path, uid, gid) < 0 || chmod(path, mode) < 0) return -1;
    return 0;
}

static int cmd_setup(int argc, char **argv)
{
    if (argc < 6 || (argc > 6 && (strcmp(argv[6], "--") || argc < 8)))
        die("usage: setup SESSIONS WORKSPACE UID GID [-- SUBCOMMAND ARGS...]");
    uid_t uid = (uid_t)strtoul(argv[4], NULL, 10);
    gid_t gid = (gid_t)strtoul(argv[5], NULL, 10);
    if (ensure_dir(argv[2], 01777, 0, 0) < 0) die("setup: %s: %s", argv[2], strerror(errno));
    if (ensure_dir(argv[3], 0755, uid, gid) < 0) die("setup: %s: %s", argv[3], strerror(errno));
    if (argc == 6) return 0;
    /* The subcommand replaces us (same argv[0]), so a server started this way
     * looks exactly like one started by its own exec. */
    argv[6] = argv[0];
    execv("/proc/self/exe", argv + 6);
    die("setup: exec %s: %s", argv[7], strerror(errno));
    return 2;
}

/*
 * boot SESSIONS WORKSPACE UID GID SOCKPATH -- ARGV...: a container's entrypoint.
 * Runs `setup SESSIONS WORKSPACE UID GID -- serve SOCKPATH` in a child and waits
 * for it (serve detaches once it listens, so the socket takes connections before
 * the task's own command starts), then becomes ARGV, the container's command as
 * it would have run without us.  A server started this way costs the start no
 * docker exec.  Its failure is printed to the container's log and does not stop
 * the command: the tools then fall back to docker exec, as for a server that died.
 */
static int cmd_boot(int argc, char **argv)
{
    if (argc < 9 || strcmp(argv[7], "--") != 0)
        die("usage: boot SESSIONS WORKSPACE UID GID SOCKPATH -- ARGV...");
    pid_t child = fork();
    if (child == 0) {
        char *setup[] = {argv[0], "setup", argv[2], argv[3], argv[4], argv[5], "--", "serve", argv[6], NULL};
        execv("/proc/self/exe", setup);
        die("boot: exec setup: %s", strerror(errno));
    }
    if (child > 0)
        while (waitpid(child, NULL, 0) < 0 && errno == EINTR) {}
    execvp(argv[8], argv + 8);
    fprintf(stderr, "tp-session: boot: cannot run %s: %s\n", argv[8], strerror(errno));
    return 127;
}

/* -------------------------------------------------------------------- put */

/*
 * put /PATH < content: through the server, shell_write_content_to_file without
 * put_archive (which costs as much as a docker exec).  Same result: parents as
 * mkparents makes them, then the old file (or symlink) replaced by a new one,
 * mode 0644, owned by the caller (the container's user).  Prints "ok";
 * "error REASON" when the parents fail; or "denied REASON" when this cannot
 * be done as the caller in the plain way -- no permission (put_archive runs
 * as root), a special file, a mount point, a special filesystem -- and the
 * caller should use put_archive after all, whatever it makes of such a path.
 */
static int cmd_put(int argc, char **argv)
{
    char msg[4400], dir[4096];
    if (argc < 3 || argv[2][0] != '/') die("usage: put /ABSOLUTE/PATH < content");
    const char *path = argv[2];
    if (make_parents(path, msg, sizeof msg) < 0) {
        printf("error %s\n", msg);
        return 0;
    }
    snprintf(dir, sizeof dir, "%s", path);
    *strrchr(dir, '/') = 0;
    struct stat sb, parent;
    const char *why = NULL;
    if (stat(*dir ? dir : "/", &parent) < 0) {
        why = strerror(errno);
    } else if (lstat(path, &sb) == 0) {
        if (!(S_ISREG(sb.st_mode) || S_ISLNK(sb.st_mode)) || sb.st_dev != parent.st_dev)
            why = "not a plain file";
        else if (unlink(path) < 0)
            why = strerror(errno);
    } else if (errno != ENOENT) {
        why = strerror(errno);
    }
    if (why) {
        printf("denied %s\n", why);
        return 0;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        printf("denied %s\n", strerror(errno));
        return 0;
    }
    char buf[65536];
    ssize_t n;
    int failed = fchmod(fd, 0644); /* whatever the umask */
    while (!failed && (n = read(0, buf, sizeof buf)) != 0) {
        if (n < 0 && errno == EINTR) continue;
        failed = n < 0 || write_all(fd, buf, (size_t)n) < 0;
    }
    if (close(fd) < 0) failed = 1;
    if (failed) {
        int err = errno;
        unlink(path);
        printf("denied %s\n", strerror(err));
        return 0;
    }
    puts("ok");
    return 0;
}

/* ------------------------------------------------------------ run-timeout */

static int cmd_run_timeout(int argc, char **argv)
{
    if (argc < 5 || strcmp(argv[3], "--") != 0) die("usage: run-timeout SECONDS -- argv...");
    double limit = strtod(argv[2], NULL);
    sigset_t chld, old;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, &old);
    pid_t child = fork();
    if (child < 0) die("fork: %s", strerror(errno));
    if (child == 0) {
        setpgid(0, 0); /* its own group, so the timeout reaches grandchildren */
        sigprocmask(SIG_SETMASK, &old, NULL);
        execvp(argv[4], argv + 4);
        dprintf(2, "tp-session: cannot run %s: %s\n", argv[4], strerror(errno));
        _exit(127);
    }
    setpgid(child, child);
    double deadline = now() + limit;
    int status;
    for (;;) {
        pid_t w = waitpid(child, &status, WNOHANG);
        if (w == child) {
            /* Leftovers of the group (a server the tests started, say) would
             * keep docker exec's output stream open: end them too. */
            kill(-child, SIGKILL);
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        double left = deadline - now();
        if (left <= 0) break;
        struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
        sigtimedwait(&chld, NULL, &ts);
    }
    kill(-child, SIGKILL);
    kill(child, SIGKILL);
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {}
    fprintf(stderr, "tp-session: timed out after %s s\n", argv[2]);
    return 124;
}

/* ------------------------------------------------------------------ serve */

/*
 * serve SOCKPATH: answer requests over a unix socket, so that a tool call costs
 * a fork+exec inside the container instead of a `docker exec` (runc exec is
 * most of that cost).  Started once per container by a plain `docker exec`
 * (no user override), so it runs as the container's configured user with the
 * environment, working directory and groups such an exec gets, and everything
 * it starts inherits exactly those: a call behaves as under `docker exec`.
 *
 * Request, client to server:
 *     "TPS1", N as 4 bytes big-endian, then N bytes of NUL-terminated strings:
 *     WORKDIR ("" = the server's own), zero or more "KEY=VALUE" to set, "",
 *     then the subcommand and its arguments.
 * The rest of the client's stream, up to its shutdown(SHUT_WR), is the
 * subcommand's stdin (put reads it; the others ignore it).
 * Reply: the subcommand's stdout and stderr on the same stream; the server
 * closing the connection ends it.  A refused request gets one line starting
 * "tp-session: ".  Only the subcommands in `served` are run, and always this
 * very binary: the server never execs anything else.
 */
#define REQUEST_MAX (4u << 20) /* > what execve takes (128 KiB per argument) */
static int run_subcommand(int argc, char **argv);
static struct stat self_at_start; /* the server's binary, to notice it being replaced */
static const char *const served[] = {"spawn", "read", "write", "kill", "mkparents", "put", NULL};
static int listen_fd = -1, lock_fd = -1;

static void refuse(int conn, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    dprintf(conn, "tp-session: ");
    vdprintf(conn, fmt, ap);
    dprintf(conn, "\n");
    va_end(ap);
    _exit(2);
}

static void read_request(int conn, char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = read(conn, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) refuse(conn, "short request");
        buf += n;
        len -= (size_t)n;
    }
}

/* The child for one connection: read the request, become `tp-session SUBCOMMAND ...`. */
static void serve_one(int conn, const char *self)
{
    /* Only the server holds these: a child slow to read its request must not
     * keep the lock (and so a restarted server) waiting. */
    close(listen_fd);
    close(lock_fd);
    signal(SIGCHLD, SIG_DFL); /* SIG_IGN would survive exec and break waitpid */
    /* SIGPIPE stays ignored across the exec: a subcommand whose client went
     * away gets EPIPE and still cleans up (spawn removes its scratch dir).
     * spawn restores the default for the commands it runs. */
    struct timeval tv = {10, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); /* a silent client cannot pin us */
    unsigned char head[8];
    read_request(conn, (char *)head, sizeof head);
    uint32_t len = (uint32_t)head[4] << 24 | (uint32_t)head[5] << 16 | (uint32_t)head[6] << 8 | head[7];
    if (memcmp(head, "TPS1", 4) != 0) refuse(conn, "not a tp-session request");
    if (len == 0 || len > REQUEST_MAX) refuse(conn, "request size %u out of range", len);
    char *req = malloc(len);
    if (!req) refuse(conn, "out of memory");
    read_request(conn, req, len);
    if (req[len - 1] != 0) refuse(conn, "malformed request");
    tv.tv_sec = 0;
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);

    size_t count = 0;
    for (uint32_t i = 0; i < len; i++) count += req[i] == 0;
    char **args = calloc(count + 2, sizeof *args); /* self + strings + NULL */
    if (!args) refuse(conn, "out of memory");
    char *p = req, *end = req + len, *workdir = p;
    p += strlen(p) + 1;
    for (; p < end && *p; p += strlen(p) + 1) {
        if (!strchr(p + 1, '=') || *p == '=') refuse(conn, "malformed environment entry");
        putenv(p); /* req lives until the exec */
    }
    if (p >= end) refuse(conn, "malformed request");
    p += strlen(p) + 1;
    size_t n = 0;
    args[n++] = (char *)self;
    for (; p < end; p += strlen(p) + 1) args[n++] = p;
    int ok = 0;
    for (const char *const *s = served; n > 1 && *s; s++) ok |= strcmp(args[1], *s) == 0;
    if (!ok) refuse(conn, "refused subcommand %s", n > 1 ? args[1] : "(none)");
    if (*workdir && chdir(workdir) < 0) refuse(conn, "chdir %s: %s", workdir, strerror(errno));

    /* The commands spawn runs get stdin from their supervisor, never this. */
    if (dup2(conn, 0) < 0 || dup2(conn, 1) < 0 || dup2(conn, 2) < 0)
        refuse(conn, "cannot set up stdio: %s", strerror(errno));
    if (conn > 2) close(conn);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    struct stat sb;
    if (stat(self, &sb) == 0 && sb.st_ino == self_at_start.st_ino && sb.st_dev == self_at_start.st_dev) {
        /* The subcommand runs in this forked child itself: no exec of the helper
         * per call (an exec costs milliseconds in a loaded VM).  The server holds
         * no other fd. */
        exit(run_subcommand((int)n, args));
    }
    execv(self, args); /* the helper was replaced since the server started: run the new one */
    refuse(1, "cannot run the helper %s: %s", self, strerror(errno));
}

/* A server listens at addr (EAGAIN: it does, with a full backlog). */
static int socket_live(const struct sockaddr_un *addr)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int live = fd >= 0 && (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0 || errno == EAGAIN);
    if (fd >= 0) close(fd);
    return live;
}

static int cmd_serve(int argc, char **argv)
{
    if (argc < 3) die("usage: serve SOCKPATH");
    const char *path = argv[2];
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) die("socket path too long: %s", path);
    strcpy(addr.sun_path, path);
    /* Requests run the binary found at this path when they come in, as a
     * docker exec would: a helper updated by put_archive takes effect at once
     * (serve_one runs a request in the server's own code while the file is
     * the one the server was started from). */
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) die("readlink /proc/self/exe: %s", strerror(errno));
    self[n] = 0;
    if (stat(self, &self_at_start) < 0) die("stat %s: %s", self, strerror(errno));

    /* One server per socket.  The lock lives as long as the server (the kernel
     * drops it when the server dies, however it dies), so two starts racing
     * never unlink each other's live socket, and a socket file nobody holds the
     * lock for is stale: remove it.  A live socket means we are not needed.  A
     * held lock without a live socket is a server whose socket file was
     * removed: it notices within a second or two and exits (see below). */
    char lockpath[4200];
    snprintf(lockpath, sizeof lockpath, "%s.lock", path);
    lock_fd = open(lockpath, O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0) die("open %s: %s", lockpath, strerror(errno));
    for (double t0 = now(); flock(lock_fd, LOCK_EX | LOCK_NB) < 0; sleep_s(0.05)) {
        if (errno != EWOULDBLOCK) die("flock %s: %s", lockpath, strerror(errno));
        if (socket_live(&addr)) return 0;
        if (now() - t0 > 5) die("%s is locked, but nobody serves on %s", lockpath, path);
    }
    if (socket_live(&addr)) return 0; /* its lock file was removed: leave it be */
    unlink(path);
    listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (listen_fd < 0) die("socket: %s", strerror(errno));
    /* Owner only: other users in the container must not run commands as us
     * (root on the host side can always connect). */
    mode_t old = umask(0177);
    int bound = bind(listen_fd, (struct sockaddr *)&addr, sizeof addr);
    umask(old);
    if (bound < 0 || listen(listen_fd, 128) < 0) die("cannot listen on %s: %s", path, strerror(errno));
    struct stat mine, sb;
    if (stat(path, &mine) < 0) die("stat %s: %s", path, strerror(errno));

    /* Listening already, so a client can connect as soon as this returns.
     * Detach: the exec that started us ends, and we keep running in a session
     * of our own with stdio released (docker waits for those to close). */
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid > 0) _exit(0);
    setsid();
    release_stdio();
    /* SIGCHLD ignored: the kernel reaps our children, no zombies.  As a
     * subreaper we also get (and so reap) the session supervisors that spawn
     * leaves behind, which would otherwise go to a pid 1 that, in many images
     * (`sleep infinity`), never reaps. */
    signal(SIGCHLD, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    for (;;) {
        /* Nobody can reach us once our socket file is gone or replaced: exit,
         * so a new server can take the lock. */
        struct pollfd pf = {listen_fd, POLLIN, 0};
        int r = poll(&pf, 1, 1000);
        if (r == 0 && (stat(path, &sb) < 0 || sb.st_ino != mine.st_ino || sb.st_dev != mine.st_dev)) _exit(0);
        if (r <= 0) continue;
        int conn = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC); /* a blocking connection */
        if (conn < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)
                sleep_s(0.05); /* out of resources: back off instead of spinning */
            continue;
        }
        /* The request is read in the child, so a slow client never blocks the loop. */
        pid = fork();
        if (pid == 0) serve_one(conn, self);
        close(conn); /* fork failed: the client sees the connection close, unanswered */
    }
}

static int run_subcommand(int argc, char **argv)
{
    if (argc < 2) die("usage: tp-session spawn|read|write|kill|mkparents|put|run-timeout|setup|serve|boot ...");
    const char *c = argv[1];
    if (!strcmp(c, "spawn")) return cmd_spawn(argc, argv);
    if (!strcmp(c, "read")) return cmd_read(argc, argv);
    if (!strcmp(c, "write")) return cmd_write(argc, argv);
    if (!strcmp(c, "kill")) return cmd_kill(argc, argv);
    if (!strcmp(c, "mkparents")) return cmd_mkparents(argc, argv);
    if (!strcmp(c, "put")) return cmd_put(argc, argv);
    if (!strcmp(c, "run-timeout")) return cmd_run_timeout(argc, argv);
    if (!strcmp(c, "setup")) return cmd_setup(argc, argv);
    if (!strcmp(c, "serve")) return cmd_serve(argc, argv);
    if (!strcmp(c, "boot")) return cmd_boot(argc, argv);
    die("unknown subcommand: %s", c);
    return 2;
}

int main(int argc, char **argv)
{
    return run_subcommand(argc, argv);
}
