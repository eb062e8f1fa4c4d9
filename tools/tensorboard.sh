#!/usr/bin/env bash
# TensorBoard on a shared login node, on a port nobody else has, with the ssh command that
# brings it to your laptop. A fixed --port 6006 fails (or shows someone else's runs) as soon
# as a second participant on the same login node has started one.
#
#   bash tools/tensorboard.sh [LOGDIR]        # default LOGDIR: runs
#
# It prints, then keeps TensorBoard running (Ctrl+C stops it):
#   on your laptop: ssh -N -L 6006:localhost:<port> <you>@<this login node>
#   then open http://localhost:6006
# The login node's own name matters: behind an alias such as jureca.fz-juelich.de stand several
# login nodes, and the tunnel must end on the one that runs your TensorBoard.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
logdir=${1:-runs}
python=${VENV:-.venv}/bin/python
# a port the kernel says is free (TensorBoard binds it a moment later)
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
host=$(hostname -f 2>/dev/null || hostname)
echo "on your laptop: ssh -N -L 6006:localhost:$port ${USER:-$(id -un)}@$host"
echo "then open http://localhost:6006   (other users of $host can reach port $port too: TensorBoard has no password)"
exec "$python" -m tensorboard.main --logdir "$logdir" --host 127.0.0.1 --port "$port"
