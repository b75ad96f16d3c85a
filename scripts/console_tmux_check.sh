#!/usr/bin/env bash
# End-to-end check of the console in a real terminal: tmux runs `moectl replay` and the live
# `moectl`, keys are sent with `tmux send-keys`, and the screen is read with
# `tmux capture-pane -p` after each one.
#
#     scripts/console_tmux_check.sh            # from anywhere; prints PASS/FAIL lines
#     KEEP=/tmp/caps scripts/console_tmux_check.sh   # also keep every capture there
#
# Exit status: 0 when every check passes, 1 otherwise (2: tmux or moectl missing). The tmux
# server is private (its own socket) and is killed on exit, whatever happens.

set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$(pwd)
MOECTL="$ROOT/.venv/bin/moectl"
TRACE="sample_traces/steady_rebalance.trace"
WIDTH=120
HEIGHT=40
SOCKET="moectl-check-$$"
SESSION="moectl"
STATUS_FILE=""
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moectl-tmux.XXXXXX")
KEEP=${KEEP:-}
FAILED=0
CAPTURES=0

# COLUMNS / LINES in the environment override the terminal's real size for Textual (through
# shutil.get_terminal_size), and tmux would hand them to the panes. Some parents export stale
# ones: under pytest, GNU readline's initialisation puts COLUMNS=80 LINES=24 into the C
# environment (invisible in os.environ), and the console then draws 80x24 in a 120x40 pane.
unset COLUMNS LINES

command -v tmux >/dev/null 2>&1 || { echo "FAIL tmux is not installed"; exit 2; }
[ -x "$MOECTL" ] || { echo "FAIL $MOECTL not found (run scripts/setup.sh)"; exit 2; }

cleanup() {
    tmux -L "$SOCKET" kill-server >/dev/null 2>&1
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# A private server with a known configuration: the pane stays after the program exits (so its
# exit status can be read), and no user ~/.tmux.conf is involved.
cat >"$WORK/tmux.conf" <<'EOF'
set -g remain-on-exit on
set -g default-terminal "tmux-256color"
set -g status off
set -g history-limit 2000
EOF

tm() { tmux -L "$SOCKET" -f "$WORK/tmux.conf" "$@"; }

screen() {  # the visible screen, as text
    tm capture-pane -p -t "$SESSION" 2>/dev/null
}

keep() {  # keep the capture under $KEEP (NN-name.txt) when asked
    CAPTURES=$((CAPTURES + 1))
    [ -n "$KEEP" ] || return 0
    mkdir -p "$KEEP"
    screen >"$KEEP/$(printf %02d "$CAPTURES")-$1.txt"
}

pass() { echo "PASS $*"; }
fail() {
    echo "FAIL $*"
    FAILED=1
    echo "---- screen ----"
    screen | sed 's/[[:space:]]*$//' | grep -v '^$' | head -"$HEIGHT"
    echo "----------------"
}

# wait_for TEXT SECONDS: until TEXT (fixed string) is on screen
wait_for() {
    local text=$1 limit=$2 waited=0
    while [ "$waited" -lt $((limit * 10)) ]; do
        if screen | grep -qF -- "$text"; then
            return 0
        fi
        sleep 0.2
        waited=$((waited + 2))
    done
    return 1
}

# wait_gone TEXT SECONDS: until TEXT is no longer on screen
wait_gone() {
    local text=$1 limit=$2 waited=0
    while [ "$waited" -lt $((limit * 10)) ]; do
        if ! screen | grep -qF -- "$text"; then
            return 0
        fi
        sleep 0.2
        waited=$((waited + 2))
    done
    return 1
}

# wait_exit SECONDS: until the program in the pane has exited; prints its exit status. The
# status comes from the wrapper in start(), not from tmux: in some environments the tmux server
# misses the SIGCHLD and never reaps the pane's process (pane_dead 1, no pane_dead_status).
wait_exit() {
    local limit=$1 waited=0
    while [ "$waited" -lt $((limit * 10)) ]; do
        if [ -s "$STATUS_FILE" ]; then
            cat "$STATUS_FILE"
            return 0
        fi
        sleep 0.2
        waited=$((waited + 2))
    done
    return 1
}

# check NAME TEXT SECONDS
check() {
    if wait_for "$2" "$3"; then pass "$1: '$2' on screen"; else fail "$1: '$2' not on screen after $3 s"; fi
    keep "$1"
}

send() { tm send-keys -t "$SESSION" "$@"; }

start() {  # start NAME COMMAND... in a fresh session; its exit status goes to $WORK/NAME.status
    local name=$1
    shift
    STATUS_FILE="$WORK/$name.status"
    rm -f "$STATUS_FILE"
    tm kill-session -t "$SESSION" >/dev/null 2>&1
    # The wrapper records the terminal size the program starts with, runs it, and writes its
    # exit status to $STATUS_FILE.
    tm new-session -d -s "$SESSION" -x "$WIDTH" -y "$HEIGHT" -c "$ROOT" \
        sh -c 'stty size >"$0.size"; "$@"; echo $? >"$0"' "$STATUS_FILE" "$@"
    local waited=0
    while [ ! -s "$STATUS_FILE.size" ] && [ "$waited" -lt 50 ]; do sleep 0.1; waited=$((waited + 1)); done
    if [ "$(cat "$STATUS_FILE.size" 2>/dev/null)" = "$HEIGHT $WIDTH" ]; then
        pass "$name: the terminal is ${WIDTH}x${HEIGHT}"
    else
        fail "$name: the terminal is not ${WIDTH}x${HEIGHT} (stty size: $(cat "$STATUS_FILE.size" 2>/dev/null))"
    fi
}

quit_and_check() {  # q, then the program must exit with status 0
    local name=$1 status
    send q
    if status=$(wait_exit 10); then
        if [ "$status" = "0" ]; then pass "$name: q exits (status 0)"; else fail "$name: q exited with status $status"; fi
    else
        local pid child
        pid=$(tm display-message -p -t "$SESSION" '#{pane_pid}' 2>/dev/null)
        fail "$name: still running 10 s after q"
        if [ -n "$pid" ]; then  # what is left of it (the pane runs sh, sh runs moectl)
            ps -o pid,ppid,stat,etime,args -p "$pid" --ppid "$pid" 2>/dev/null | sed 's/^/  /'
            for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do
                for task in /proc/"$child"/task/*; do
                    echo "  $child thread $(cat "$task/comm" 2>/dev/null) state" \
                         "$(cut -d' ' -f3 "$task/stat" 2>/dev/null) wchan $(cat "$task/wchan" 2>/dev/null)"
                done
            done
        fi
    fi
    keep "$name-exit"
}

T0=$(date +%s)

# -- replay -----------------------------------------------------------------------------------
start replay "$MOECTL" replay "$TRACE"
check "replay start" "Overview" 20
check "replay overview" "Expert rows per device" 5
# the app draws on the whole terminal: its widest line (the tabs' underline) is $WIDTH wide
drawn=$(screen | while IFS= read -r line; do printf '%s' "$line" | LC_ALL=C.UTF-8 wc -m; done | sort -n | tail -1)
if [ "$drawn" = "$WIDTH" ]; then pass "replay: the app draws $WIDTH columns"; else fail "replay: the app draws $drawn columns, not $WIDTH"; fi
check "replay transport" "Play" 5

send Space
check "replay play" "Pause" 5
# the replay advances: the window fills, so the Overview's throughput leaves 0 tok/s (the
# transport's "step N of" status is cut off at 120 columns, so it cannot be the witness)
if wait_gone "throughput 0 tok/s" 8 && screen | grep -qE "throughput [0-9,]+ tok/s"; then
    pass "replay play: the replay advances ($(screen | grep -oE 'throughput [0-9,]+ tok/s' | head -1))"
else
    fail "replay play: throughput stays at 0 tok/s"
fi
keep "replay-advances"

send 2
check "experts tab" "Routing heat map" 5
send r
# At 120x40 the preview's result sits below the fold (under the heat map, the plots and the
# placement) and replay raises no notification: focus the panel (tab) and scroll to its end.
sleep 0.5
send Tab
send End
check "rebalance preview" "predicted balancedness" 5

send 5
check "requests tab" "TTFT (ms), finished requests" 5

send '?'
check "help" "moectl console keys" 5
send Escape
if wait_gone "moectl console keys" 5; then pass "help: escape closes it"; else fail "help: still open after escape"; fi
keep "help-closed"

quit_and_check "replay"

# -- live -------------------------------------------------------------------------------------
start live "$MOECTL"
check "live start" "tok/s" 45
if wait_gone "throughput 0 tok/s" 20; then
    pass "live: throughput is non-zero ($(screen | grep -o 'throughput [0-9,]* tok/s' | head -1))"
else
    fail "live: throughput stays at 0 tok/s"
fi
keep "live-running"
# the console's process draws without torch (the Memory tab's plan included: the engine computes
# it); the engine process it started holds torch
send 3
check "live memory tab" "HBM" 5
send 1
pane=$(tm display-message -p -t "$SESSION" '#{pane_pid}' 2>/dev/null)
console_pid=$(ps -o pid= --ppid "$pane" 2>/dev/null | head -1 | tr -d ' ')
engine_pid=$(ps -o pid= --ppid "$console_pid" 2>/dev/null | head -1 | tr -d ' ')
if [ -n "$console_pid" ] && [ -r "/proc/$console_pid/maps" ] && ! grep -q libtorch "/proc/$console_pid/maps"; then
    pass "live: the console's process ($console_pid) has not loaded torch"
else
    fail "live: the console's process (${console_pid:-not found}) has loaded torch"
fi
if [ -n "$engine_pid" ] && grep -q "engine-host" "/proc/$engine_pid/cmdline" 2>/dev/null \
        && grep -q libtorch "/proc/$engine_pid/maps" 2>/dev/null; then
    pass "live: the engine runs in its own process ($engine_pid)"
else
    fail "live: no engine process under the console (${engine_pid:-none})"
fi
quit_and_check "live"
if [ -n "$engine_pid" ] && kill -0 "$engine_pid" 2>/dev/null \
        && [ "$(cut -d' ' -f3 "/proc/$engine_pid/stat" 2>/dev/null)" != "Z" ]; then
    fail "live: the engine process ($engine_pid) is still running after q"
else
    pass "live: q leaves no engine process behind"
fi

# -- live, its engine killed -------------------------------------------------------------------
start live-kill "$MOECTL"
check "live-kill start" "tok/s" 45
pane=$(tm display-message -p -t "$SESSION" '#{pane_pid}' 2>/dev/null)
console_pid=$(ps -o pid= --ppid "$pane" 2>/dev/null | head -1 | tr -d ' ')
engine_pid=$(ps -o pid= --ppid "$console_pid" 2>/dev/null | head -1 | tr -d ' ')
kill -9 "$engine_pid" 2>/dev/null
check "live-kill: the console names the dead engine" "moectl engine (pid $engine_pid) is gone" 2
send 2  # still usable for inspection
check "live-kill: still usable" "Routing heat map" 5
send q
if status=$(wait_exit 10) && [ "$status" = "1" ]; then
    pass "live-kill: q exits with status 1 (the engine died under it)"
else
    fail "live-kill: q exited with status ${status:-none}, not 1"
fi

echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$FAILED" -eq 0 ]; then
    echo "PASS all console checks"
    exit 0
fi
echo "FAIL some console checks"
exit 1
