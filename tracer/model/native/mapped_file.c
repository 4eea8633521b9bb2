/* A file truncated under a run that reads its blocks in place: one line and exit status 2, not SIGBUS's silent death.
 *
 * The loader holds a GGUF's stored blocks, where a kernel reads them as they lie, in a private map of the file
 * (tracer/load/file_map.py), as llama.cpp does: no copy, no fresh pages. A page of a map past the end of a file that
 * shrank raises SIGBUS when touched (a scale check at load, a product later, on any thread), and no check before a
 * touch closes the window. So each map is registered here with the line that says what happened; the handler, for a
 * fault inside a registered map, writes that line to stderr and ends the process with status 2 (the CLI's status for
 * bad input). Anything else (a fault elsewhere, a SIGBUS sent by kill) goes to the action that was there before.
 * Only async-signal-safe calls run in the handler: write, _exit, sigaction, raise.
 */

#define _GNU_SOURCE
#include "kernels.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#define MAX_MAPS 32
#define MAX_LINE 1024

static struct {
    volatile uintptr_t low, high; /* high == 0: a free slot */
    char line[MAX_LINE];
    volatile size_t length;
} maps[MAX_MAPS];
static struct sigaction before;
static int installed;

static void on_sigbus(int signal_number, siginfo_t *info, void *context) {
    (void)context;
    uintptr_t at = (uintptr_t)info->si_addr;
    if (info->si_code > 0) { /* raised by a fault: si_addr is the faulting address */
        for (int i = 0; i < MAX_MAPS; i++) {
            if (maps[i].high && maps[i].low <= at && at < maps[i].high) {
                ssize_t written = write(2, maps[i].line, maps[i].length);
                (void)written;
                _exit(2);
            }
        }
    }
    sigaction(SIGBUS, &before, NULL); /* not ours: the previous action takes this one (a fault re-runs into it) */
    if (info->si_code <= 0) raise(signal_number);
}

/* Register bytes [base, base + length) as a map whose SIGBUS means `line` (written as given: end it with '\n').
   0 when registered; -1 when every slot is taken or the handler cannot be installed (the map then dies of SIGBUS
   as before). */
int llmt_guard_map(const void *base, int64_t length, const char *line) {
    if (!installed) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = on_sigbus;
        action.sa_flags = SA_SIGINFO;
        sigemptyset(&action.sa_mask);
        if (sigaction(SIGBUS, &action, &before) != 0) return -1;
        installed = 1;
    }
    for (int i = 0; i < MAX_MAPS; i++) {
        if (!maps[i].high) {
            size_t n = strlen(line);
            if (n > MAX_LINE) n = MAX_LINE;
            memcpy(maps[i].line, line, n);
            maps[i].length = n;
            maps[i].low = (uintptr_t)base;
            maps[i].high = (uintptr_t)base + (uintptr_t)length; /* set last: the handler reads a whole slot */
            return 0;
        }
    }
    return -1;
}

/* Forget the map at `base` (it is about to be unmapped: the range may be reused by another mapping). */
void llmt_unguard_map(const void *base) {
    for (int i = 0; i < MAX_MAPS; i++) {
        if (maps[i].high && maps[i].low == (uintptr_t)base) maps[i].high = 0;
    }
}
