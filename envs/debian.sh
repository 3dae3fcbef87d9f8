#!/usr/bin/env bash
# The Debian packages the project's scripts use, installed in one apt pass: those of PACKAGE... that are missing,
# with one `apt-get update` and one `apt-get install`. The packages' own daemons are kept from starting
# (policy-rc.d; there is no init system here): the project's scripts start their own. Run as root; idempotent.
#
#   bash envs/debian.sh PACKAGE...
#
# Each service script's `packages` command prints what it needs; tests/run.sh installs them all at once.
set -euo pipefail

missing=()
for package in "$@"; do
  dpkg-query -W -f='${Status}\n' "$package" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$package")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
# Docker images usually ship a policy-rc.d already; only add (and remove) one when absent.
added=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && added=1
fi
trap 'if [ "$added" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT
echo "debian.sh: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
