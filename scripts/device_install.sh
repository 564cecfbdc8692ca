# Sourced by scripts/gpu_check.sh and scripts/ep_check.sh, which define PY, LOG and log().
# install_turbo_moe: on a device machine without network, install the carried wheels (.whl/) into
# /tmp/site, then the repository itself (editable); if that fails (e.g. the machine's setuptools
# is older than pyproject's build requirement), run from the source tree instead.
install_turbo_moe() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      log "installed wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
    else
      log "WARNING: installing .whl/*.whl failed (see above); what needs them will be reported missing"
    fi
  fi
  if "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
    log "installed turbo_moe (editable)"
  else
    ln -sfn ../kernels turbo_moe/kernels
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    log "pip install -e . failed (see above); running from the source tree (PYTHONPATH, turbo_moe/kernels link)"
  fi
}
