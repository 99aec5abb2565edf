#!/bin/sh
# Container entry point. A compose file secret is a bind mount that keeps the host file's
# owner and mode (0600, the host user), which the container's `meshnode` user cannot read.
# Started as root, this copies the token into the node's state dir as the node's own token
# file (owner meshnode, 0600; `join` reads it when no --token/--token-file is given), then
# drops to the meshnode user for good. Started as any other user, it runs meshnode as is.
set -eu
secret=/run/secrets/mesh_token
state="${MESHNODE_STATE_DIR:-/var/lib/meshnode}"
if [ "$(id -u)" = 0 ]; then
    if [ -f "$secret" ]; then
        install -d -o meshnode -g meshnode -m 0700 "$state"
        install -o meshnode -g meshnode -m 0600 "$secret" "$state/mesh-token"
    fi
    exec setpriv --reuid=meshnode --regid=meshnode --init-groups -- meshnode "$@"
fi
exec meshnode "$@"
