#!/bin/bash
# spotnb @VERSION@ bootstrap for job @JOB_ID@ (spotnb.providers.aws.bootstrap says
# what it does). No credentials here: the instance role has them.
set -Eeuo pipefail
JOB_URI=@JOB_URI@
JOB_ID=@JOB_ID@
WHEEL=@WHEEL@
WHEEL_SHA256=@WHEEL_SHA256@
BOOTSTRAP_KEY=@BOOTSTRAP_KEY@
GROUP=@GROUP@
TEMPLATE=@TEMPLATE@
DLAMI_PYTHON=@DLAMI_PYTHON@
BOOT_FAILURE_LIMIT=@BOOT_FAILURE_LIMIT@
AGENT_TRIES=@AGENT_TRIES@
AGENT_RETRY_SECONDS=@AGENT_RETRY_SECONDS@
UNIT=@UNIT@
# The job's bucket is in its home region, wherever this instance runs: every S3 client
# of spotnb here (and the AWS CLI's download below) asks that region.
STORE_REGION=@STORE_REGION@
if [ -n "$STORE_REGION" ]; then export SPOTNB_STORE_REGION="$STORE_REGION"; fi
MODE="${1:-first-boot}"
WORK="${SPOTNB_INSTANCE_DIR:-/opt/spotnb}"
VENV="$WORK/venv"
LOG="$WORK/bootstrap.log"
IMDS="${SPOTNB_IMDS_ENDPOINT:-${AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}}"
IID="" REGION="" ITYPE="" AZ_ID="" BASE="" STEP="starting"

umask 022
mkdir -p "$WORK" || { poweroff || shutdown -h now; exit 1; }
cd "$WORK"
exec >>"$LOG" 2>&1
say() { echo "spotnb-boot: $*"; }
say "$MODE of job $JOB_ID at $(date -u +%Y-%m-%dT%H:%M:%SZ)"

failed() {  # the ERR trap: say what failed, report it to the job, end the instance
  local code=$1 py candidate
  # A failure inside $(...) or a pipeline's subshell: its caller fails in turn.
  [ "$BASH_SUBSHELL" -eq 0 ] || exit "$code"
  trap - ERR
  set +e
  say "step failed (exit $code): $STEP"
  py=""
  for candidate in "$VENV/bin/python" "$BASE" "$DLAMI_PYTHON" python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    [ -n "$py" ] || py="$candidate"  # any Python: the AWS CLI, if boto3 is nowhere
    if "$candidate" -c 'import boto3' >/dev/null 2>&1; then py="$candidate"; break; fi
  done
  if [ -n "$py" ] && [ -s "$WORK/bootreport.py" ]; then
    "$py" "$WORK/bootreport.py" --job-uri "$JOB_URI" --job-id "$JOB_ID" \
      --instance "${IID:-unknown-$(hostname)}" --instance-type "$ITYPE" --az "$AZ_ID" \
      --region "$REGION" --step "$STEP" --code "$code" --limit "$BOOT_FAILURE_LIMIT" \
      --log "$LOG" --group "$GROUP" --template "$TEMPLATE"
  else
    say "no Python (or no base64 and gzip) here: the failure cannot reach the job"
  fi
  say "powering off: EC2 terminates this instance"
  sync
  poweroff || shutdown -h now
  exit "$code"
}
trap 'failed $?' ERR

STEP="unpacking the failure report"  # bootreport.py, gzipped: run by whichever Python can
base64 -d <<'SPOTNB_BOOTREPORT' | gzip -dc >"$WORK/bootreport.py"
@BOOTREPORT@
SPOTNB_BOOTREPORT

imds() {  # imds PATH: one metadata value, with an IMDSv2 session token
  local token
  token=$(curl -sSf --max-time 5 --retry 5 --retry-connrefused -X PUT \
    -H "X-aws-ec2-metadata-token-ttl-seconds: 300" "$IMDS/latest/api/token")
  curl -sSf --max-time 5 --retry 5 --retry-connrefused \
    -H "X-aws-ec2-metadata-token: $token" "$IMDS/latest/meta-data/$1"
}

STEP="reading the instance's identity from its metadata service (IMDSv2)"
IID=$(imds instance-id)
REGION=$(imds placement/region)
ITYPE=$(imds instance-type)
AZ_ID=$(imds placement/availability-zone-id)
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-$REGION}"

if [ "$MODE" = agent ]; then
  # Every boot: the instance agent, in the environment the first boot made.
  STEP="finding the Python environment the first boot made ($WORK/agent-python)"
  PY=$(cat "$WORK/agent-python")
  [ -x "$PY" ]
  tries=0
  while :; do
    STEP="running the instance agent ($PY -m spotnb.providers.aws.instance)"
    code=0
    "$PY" -m spotnb.providers.aws.instance --job "$JOB_URI" || code=$?
    [ "$code" -eq 0 ] && exit 0  # the job is over (or moved on): its group ends us
    tries=$((tries + 1))
    say "the instance agent exited with $code ($tries of $AGENT_TRIES in a row)"
    if [ "$tries" -ge "$AGENT_TRIES" ]; then
      STEP="running the instance agent: it exited with $code, $tries times in a row"
      false
    fi
    sleep "$AGENT_RETRY_SECONDS"
  done
fi

install -m 0700 "$0" "$WORK/boot.sh"
PY="${SPOTNB_PYTHON:-}"
if [ -z "$PY" ]; then
  STEP="finding a Python 3.10 or newer on this image ($DLAMI_PYTHON, python3)"
  BASE="${SPOTNB_BASE_PYTHON:-}"
  if [ -z "$BASE" ]; then
    if [ -x "$DLAMI_PYTHON" ]; then BASE="$DLAMI_PYTHON"; else BASE=$(command -v python3); fi
  fi
  "$BASE" -c 'import sys; sys.exit(sys.version_info < (3, 10))'

  STEP="creating spotnb's Python environment $VENV on $BASE"
  if [ ! -x "$VENV/bin/python" ]; then
    # ensurepip gives the environment its own pip; an image without it (Debian and
    # Ubuntu without python3-venv) lends its pip (below, pip --python, pip >= 22.3).
    "$BASE" -m venv "$VENV" || { rm -rf "$VENV"; "$BASE" -m venv --without-pip "$VENV"; }
  fi
  # What the image's Python sees (the DLAMI's torch), after what is installed here: as
  # --system-site-packages would, also for a base that is itself a virtual environment
  # (site.addsitedir: their .pth files count too).
  "$BASE" - >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_spotnb_base.pth" <<'SITES'
import os, site
for path in site.getsitepackages():
    if os.path.isdir(path):
        print(f"import site; site.addsitedir({path!r})")
SITES
  pip_install() {
    if "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
      "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"
    else
      "$BASE" -m pip --python "$VENV/bin/python" install --disable-pip-version-check "$@"
    fi
  }
  get_s3() {  # get_s3 URI FILE, with the AWS CLI or boto3
    if command -v aws >/dev/null 2>&1; then
      aws s3 cp --only-show-errors ${STORE_REGION:+--region "$STORE_REGION"} "$1" "$2"
    else
      "$VENV/bin/python" - "$1" "$2" <<'DOWNLOAD'
import os, sys, boto3
bucket, _, key = sys.argv[1][len("s3://"):].partition("/")
region = os.environ.get("SPOTNB_STORE_REGION") or None
boto3.client("s3", region_name=region).download_file(bucket, key, sys.argv[2])
DOWNLOAD
    fi
  }
  if ! command -v aws >/dev/null 2>&1 && ! "$VENV/bin/python" -c 'import boto3' 2>/dev/null; then
    STEP="installing boto3 with pip (no AWS CLI on this image to download the job's spotnb)"
    pip_install --quiet boto3
  fi

  STEP="downloading the job's spotnb from $JOB_URI/$BOOTSTRAP_KEY"
  get_s3 "$JOB_URI/$BOOTSTRAP_KEY" "$WORK/$WHEEL"
  STEP="checking the SHA-256 of $WHEEL (the job's own wheel)"
  echo "$WHEEL_SHA256  $WORK/$WHEEL" | sha256sum --check --quiet

  STEP="installing spotnb and its dependencies with pip into $VENV"
  pip_install --quiet "$WORK/$WHEEL[aws]"
  PY="$VENV/bin/python"
  STEP="checking that $PY runs this spotnb"
  "$PY" -c 'import spotnb.providers.aws.instance, spotnb.kernel_remote'
fi
echo "$PY" >"$WORK/agent-python"

UNITS="${SPOTNB_SYSTEMD_UNIT_DIR:-/etc/systemd/system}"
if command -v systemctl >/dev/null 2>&1 && { [ -n "${SPOTNB_SYSTEMD_UNIT_DIR:-}" ] || [ -d /run/systemd/system ]; }; then
  STEP="starting the instance agent as the systemd unit $UNIT"
  cat >"$UNITS/$UNIT" <<UNITFILE
[Unit]
Description=spotnb instance agent (job $JOB_ID)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
Environment=SPOTNB_INSTANCE_DIR=$WORK
WorkingDirectory=$WORK
ExecStart=/bin/bash $WORK/boot.sh agent

[Install]
WantedBy=multi-user.target
UNITFILE
  systemctl daemon-reload
  systemctl enable "$UNIT"
  systemctl start --no-block "$UNIT"
  say "the instance agent runs as $UNIT, at this and every later boot"
  exit 0
fi
say "no systemd here: the instance agent runs in this script (not again after a reboot)"
exec /bin/bash "$WORK/boot.sh" agent
