# cmake -DOBJ=<object> -DDEPS=<depfile> -P fresh_object.cmake
# Fails when a file the depfile lists (a csrc/cpu source and the headers it includes, from the syntax check's
# -MMD) is newer than the prebuilt object OBJ: the object (from setup.py) predates an edit, and linking it
# would test old code. CMakeLists.txt runs this for each MPFUSED_CPU_OBJECTS entry.
file(READ "${DEPS}" text)
string(REPLACE "\\\n" " " text "${text}")
string(REGEX REPLACE "^[^:]*:" "" text "${text}")  # drop the target
separate_arguments(deps UNIX_COMMAND "${text}")
foreach(dep IN LISTS deps)
  if(EXISTS "${dep}" AND NOT "${OBJ}" IS_NEWER_THAN "${dep}")
    message(FATAL_ERROR "${OBJ} is older than ${dep}: rebuild the extension first (make build), or configure "
                        "with -DMPFUSED_CPU_OBJECTS= to compile csrc/cpu here")
  endif()
endforeach()
