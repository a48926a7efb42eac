# Sourced by the device scripts: install carried wheels (.whl/) and put the repo on PYTHONPATH.
# .whl/ holds nbval + ipykernel + nbclient and their pure-Python deps, and numpy 2.2.6 (cp312 manylinux):
# the GPU image's numpy >= 2.3 breaks triton 3.6's interpreter, which notebook 03 uses on every machine.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
