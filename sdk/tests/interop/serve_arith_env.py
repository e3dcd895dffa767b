"""Serve arith_env.py with ors-sdk's, openreward's or plait's own server (run with that SDK's
python).

python serve_arith_env.py ors|openreward|plait PORT
"""

import pathlib
import sys
import types

sdk, port = sys.argv[1], int(sys.argv[2])
path = pathlib.Path(__file__).with_name("arith_env.py")
source = path.read_text()
if sdk == "openreward":
    source = source.replace("from ors import", "from openreward.environments import")
    from openreward.environments import Server
elif sdk == "plait":
    source = source.replace("from ors import", "from plait_sdk import")
    from plait_sdk import Server
else:
    from ors import Server
module = types.ModuleType("arith_env")
sys.modules["arith_env"] = module
exec(compile(source, str(path), "exec"), module.__dict__)
Server([module.ArithEnv]).run(host="127.0.0.1", port=port)
