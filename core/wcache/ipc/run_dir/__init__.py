"""The run dir: every file name in it (`paths`), the directory's checks, daemon descriptors, locks and census
(`directory`), what loading ranks (`loading`) and serving engines (`engines`) publish there, and a daemon's key
from its descriptor (`remote_key`)."""
