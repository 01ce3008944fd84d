"""The observation texts of the tools (docs/tools.md): the policy learned to read them, keep
them exact."""

NO_OUTPUT = "Command executed successfully (no output)."
STARTED = (
    "Session '{id}' started.\n\nYou could use:\n  - shell_view('{id}') - get output\n"
    "  - shell_write_to_process('{id}', '<input>') - send input\n  - shell_kill_process('{id}') - terminate"
)
EXISTS = "Error: Session '{id}' already exists and is running. Use a different ID or kill the existing session first."
TIMED_OUT = (
    "Command did not complete within {timeout} seconds. Process continues in background as session "
    "'{id}'.\n\nYou can use:\n  - shell_view('{id}') - get output\n  - shell_kill_process('{id}') - terminate"
)
NO_SESSION = "Error: No session found with ID '{id}'."
IDLE = (
    "[No new output]\nSession is running but idle. Actions could take:\n"
    "  - For interactive sessions: Send input with shell_write_to_process()\n"
    "  - For long tasks: Check again later (don't poll too frequently)"
)
TERMINATED = "\n\n--- SESSION TERMINATED ---"
TERMINATED_NO_NEW = "--- SESSION TERMINATED (no new output) ---"
STILL_RUNNING = (
    "[Process still running]\nCommand is executing in background. Check again later for output.\n"
    "Use shell_kill_process() to terminate if needed."
)
COMPLETED = "\n\n--- SESSION COMPLETED ---"
NO_ACTIVE = "Error: No active non-blocking session found with ID '{id}'."
SENT_NO_OUTPUT = "Input sent to session '{id}' successfully (no output)."
STILL_OUTPUTTING = (
    "\n--- WARNING: Process is still actively outputting after max wait time. "
    "Consider waiting before sending the next command. ---"
)
WRITE_TERMINATED = "\n--- SESSION TERMINATED ---"
WRITTEN = "Content successfully written to '{path}' in Docker container."
WRITE_FAILED = "Error writing to file '{path}' in Docker container: {reason}"
KILLED = "Process in session '{id}' has been terminated."
NOT_RUNNING = "Session '{id}' is not running."

# Added where output was cut (OutputLimits); the texts above are otherwise never changed.
OMITTED = "[... {count} earlier {unit} of output not shown (output limit) ...]\n"

# The errors run_tool returns as observations (docs/tools.md, docs/http-api.md).
UNKNOWN_TOOL = "[TOOL_ERROR] unknown tool: {name}"
TOOL_FAILED = "[TOOL_ERROR] {name}: {type}: {error}"
